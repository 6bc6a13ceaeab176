"""Request traces: synthetic ones drawn from a preset's statistics, or a user's JSONL file."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from pagedkv.simulate.errors import TraceError
from pagedkv.simulate.presets import ChatTracePreset, TracePreset, UniformTracePreset

# Coefficient of variation of the synthetic log-normal lengths. The presets publish means only;
# a CV of 1 gives the long right tail that chat and code traces show. This shape is our
# assumption, not a published number: give a JSONL trace to use real lengths.
LENGTH_CV = 1.0


@dataclass(frozen=True)
class Request:
    """One request: prompt and output lengths in tokens, arrival time in seconds.

    Requests with the same `prefix_id` share their first `prefix_len` prompt tokens, so the
    paged system can share those blocks through its prefix cache. Requests of one
    `conversation` are turns of one token history: a turn's prompt is the history's first
    `prompt_len` tokens and its output the next `output_len`. A later turn with a `think`
    time arrives that many seconds after the previous turn finishes (not at `arrival`).
    """

    prompt_len: int
    output_len: int
    arrival: float = 0.0
    prefix_id: str | None = None
    prefix_len: int = 0
    conversation: str | None = None
    think: float | None = None

    @property
    def final_len(self) -> int:
        """Tokens held when the last output token is stored."""
        return self.prompt_len + self.output_len


def poisson_arrivals(num: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Arrival times of a Poisson process of `rate` requests/s; all at 0 when rate is inf."""
    if not rate > 0:
        raise TraceError(f"arrival rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / rate, size=num))]


def _lognormal_lengths(mean: float, normals: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """Positive integer lengths from standard normals: a log-normal of `mean` and LENGTH_CV."""
    sigma2 = math.log1p(LENGTH_CV**2)
    mu = math.log(mean) - sigma2 / 2
    return np.maximum(1, np.rint(np.exp(mu + math.sqrt(sigma2) * normals))).astype(np.int64)


def _calibrated_means(preset: TracePreset, max_len: int) -> tuple[float, float]:
    """Log-normal means whose draws, after dropping pairs over `max_len`, keep the preset's means.

    Dropping the long pairs (and rounding) lowers the means; a fixed-point iteration on a
    large fixed sample scales them back up. A preset that cannot fit is an error.
    """
    rng = np.random.default_rng(0)  # fixed: the calibration is part of the preset, not the run
    zp, zo = rng.standard_normal((2, 200_000))
    mp, mo = preset.mean_prompt, preset.mean_output
    for _ in range(100):
        p, o = _lognormal_lengths(mp, zp), _lognormal_lengths(mo, zo)
        fits = p + o <= max_len
        if fits.sum() < 1000:
            break
        got_p, got_o = float(p[fits].mean()), float(o[fits].mean())
        if (
            abs(got_p / preset.mean_prompt - 1) < 1e-3
            and abs(got_o / preset.mean_output - 1) < 1e-3
        ):
            return mp, mo
        mp *= preset.mean_prompt / got_p
        mo *= preset.mean_output / got_o
    raise TraceError(
        f"trace {preset.name!r} (mean prompt {preset.mean_prompt:g}, output "
        f"{preset.mean_output:g} tokens) cannot keep its means under max length {max_len}; "
        "raise --max-len or pick a model with a longer context"
    )


def synthetic_trace(
    preset: TracePreset, num_requests: int, *, max_len: int, rate: float, seed: int
) -> list[Request]:
    """`num_requests` requests with the preset's mean lengths, seeded and reproducible.

    Prompt and output lengths are independent log-normals (coefficient of variation
    LENGTH_CV); a pair whose total exceeds `max_len` is drawn again, and the log-normals'
    means are calibrated so that the kept pairs still have the preset's means.
    """
    if num_requests < 1:
        raise TraceError(f"number of requests must be at least 1, got {num_requests}")
    if max_len < 2:
        raise TraceError(f"max length must be at least 2, got {max_len}")
    mean_prompt, mean_output = _calibrated_means(preset, max_len)
    rng = np.random.default_rng(seed)
    prompts: list[int] = []
    outputs: list[int] = []
    while len(prompts) < num_requests:  # calibration guarantees a useful acceptance rate
        need = num_requests - len(prompts)
        p = _lognormal_lengths(mean_prompt, rng.standard_normal(2 * need))
        o = _lognormal_lengths(mean_output, rng.standard_normal(2 * need))
        fits = p + o <= max_len
        prompts.extend(p[fits][:need].tolist())
        outputs.extend(o[fits][:need].tolist())
    arrivals = poisson_arrivals(num_requests, rate, rng)
    return [Request(p, o, a) for p, o, a in zip(prompts, outputs, arrivals, strict=True)]


def uniform_trace(
    preset: UniformTracePreset, num_requests: int, *, max_len: int, rate: float, seed: int
) -> list[Request]:
    """`num_requests` requests with lengths uniform in the preset's ranges, seeded."""
    if num_requests < 1:
        raise TraceError(f"number of requests must be at least 1, got {num_requests}")
    longest = preset.prompt[1] + preset.output[1]
    if longest > max_len:
        raise TraceError(
            f"trace {preset.name!r} reaches {longest} tokens, over the max length {max_len}; "
            "raise --max-len"
        )
    rng = np.random.default_rng(seed)
    prompts = rng.integers(preset.prompt[0], preset.prompt[1], size=num_requests, endpoint=True)
    outputs = rng.integers(preset.output[0], preset.output[1], size=num_requests, endpoint=True)
    arrivals = poisson_arrivals(num_requests, rate, rng)
    return [Request(int(p), int(o), a) for p, o, a in zip(prompts, outputs, arrivals, strict=True)]


def chat_trace(
    preset: ChatTracePreset, num_requests: int, *, max_len: int, rate: float, seed: int
) -> list[Request]:
    """Sessions of `preset.turns` turns (the last may be cut to make `num_requests`): sessions
    start as a Poisson process of `rate`; each later turn arrives a think time after the
    previous one finishes (listed at its session's start, so the trace stays sorted).

    Turn k + 1's prompt is turn k's prompt, its output and a new message; a session ends
    early rather than exceed `max_len`.
    """
    if num_requests < 1:
        raise TraceError(f"number of requests must be at least 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    sessions = -(-num_requests // preset.turns)
    starts = poisson_arrivals(sessions, rate, rng)
    requests: list[Request] = []
    for session, start in enumerate(starts):
        left = min(preset.turns, num_requests - session * preset.turns)
        messages = _lognormal_lengths(preset.mean_message, rng.standard_normal(left))
        outputs = _lognormal_lengths(preset.mean_output, rng.standard_normal(left))
        thinks = rng.exponential(preset.think, size=left)
        history = 0
        for turn in range(left):
            prompt = history + int(messages[turn])
            if prompt + int(outputs[turn]) > max_len:
                break
            think = float(thinks[turn]) if turn > 0 else None
            name = f"session {session}"
            requests.append(Request(prompt, int(outputs[turn]), start, None, 0, name, think))
            history = prompt + int(outputs[turn])
    if not requests:
        raise TraceError(f"trace {preset.name!r}: no turn fits the max length {max_len}")
    return sorted(requests, key=lambda r: r.arrival)


def final_histories(trace: Sequence[Request]) -> list[int]:
    """Each conversation's history at its last turn (prompt and output), in tokens."""
    last: dict[str, int] = {}
    for request in trace:
        if request.conversation is not None:
            last[request.conversation] = request.final_len
    return list(last.values())


def next_turns(trace: Sequence[Request]) -> dict[int, int]:
    """Index of each turn -> index of the turn that arrives after it finishes (`think`)."""
    previous: dict[str, int] = {}
    follows: dict[int, int] = {}
    for i, request in enumerate(trace):
        if request.think is not None:
            if request.conversation not in previous or request.think < 0:
                raise TraceError(
                    f"request {i}: a think time needs an earlier turn of its conversation and "
                    f"must not be negative, got {request.think} in {request.conversation!r}"
                )
            follows[previous[request.conversation]] = i
        if request.conversation is not None:
            previous[request.conversation] = i
    return follows


def _positive_int(record: dict[str, object], key: str, where: str) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _parse_line(record: object, where: str, max_len: int) -> tuple[Request, bool]:
    """One JSONL record as a Request, and whether it carried an arrival time."""
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    known = {"prompt_len", "output_len", "prefix_id", "prefix_len", "arrival"}
    unknown = sorted(set(record) - known)
    if unknown:
        raise TraceError(f"{where}: unknown field {unknown[0]!r} (known: {sorted(known)})")
    prompt_len = _positive_int(record, "prompt_len", where)
    output_len = _positive_int(record, "output_len", where)
    if prompt_len + output_len > max_len:
        raise TraceError(
            f"{where}: prompt_len + output_len = {prompt_len + output_len} exceeds the max "
            f"length {max_len} (raise --max-len)"
        )
    prefix_id: str | None = None
    prefix_len = 0
    if "prefix_id" in record:
        raw = record["prefix_id"]
        if isinstance(raw, bool) or not isinstance(raw, str | int):
            raise TraceError(f"{where}: prefix_id must be a string or integer, got {raw!r}")
        prefix_id = str(raw)
        prefix_len = prompt_len
        if "prefix_len" in record:
            prefix_len = _positive_int(record, "prefix_len", where)
            if prefix_len > prompt_len:
                raise TraceError(
                    f"{where}: prefix_len {prefix_len} is longer than prompt_len {prompt_len}"
                )
    elif "prefix_len" in record:
        raise TraceError(f"{where}: prefix_len given without prefix_id")
    arrival = 0.0
    has_arrival = "arrival" in record
    if has_arrival:
        raw = record["arrival"]
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
            raise TraceError(f"{where}: arrival must be a finite number, got {raw!r}")
        if raw < 0:
            raise TraceError(f"{where}: arrival must not be negative, got {raw!r}")
        arrival = float(raw)
    return Request(prompt_len, output_len, arrival, prefix_id, prefix_len), has_arrival


def parse_jsonl(
    lines: Sequence[str], *, name: str, max_len: int, rate: float, seed: int
) -> list[Request]:
    """Requests from JSONL lines (one object per line; blank lines skipped), sorted by arrival.

    Fields: `prompt_len`, `output_len` (positive integers), optional `prefix_id` (string or
    integer) with optional `prefix_len` (default: the whole prompt), optional `arrival`
    (seconds). When no line has an arrival, arrivals follow `rate` as for synthetic traces.
    """
    requests: list[Request] = []
    with_arrival = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        request, has_arrival = _parse_line(record, where, max_len)
        requests.append(request)
        with_arrival += has_arrival
    if not requests:
        raise TraceError(f"{name}: the trace has no requests")
    if 0 < with_arrival < len(requests):
        raise TraceError(
            f"{name}: {with_arrival} of {len(requests)} requests have an arrival time; "
            "give it on every line or on none"
        )
    if with_arrival == 0:
        return with_poisson_arrivals(requests, rate, seed)
    return sorted(requests, key=lambda r: r.arrival)  # stable: ties keep file order


def with_poisson_arrivals(requests: Sequence[Request], rate: float, seed: int) -> list[Request]:
    """`requests` in their order, arriving as a seeded Poisson process of `rate` requests/s."""
    arrivals = poisson_arrivals(len(requests), rate, np.random.default_rng(seed))
    return [
        Request(r.prompt_len, r.output_len, a, r.prefix_id, r.prefix_len)
        for r, a in zip(requests, arrivals, strict=True)
    ]


def load_jsonl(path: Path, *, max_len: int, rate: float, seed: int) -> list[Request]:
    """Requests from a JSONL file; see `parse_jsonl` for the fields."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {str(path)!r} is not UTF-8 text") from None
    return parse_jsonl(text.splitlines(), name=str(path), max_len=max_len, rate=rate, seed=seed)

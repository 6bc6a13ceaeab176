//! The state group of a `HybridManager`: working slots, checkpoints saved at prompt ends,
//! branch points and intervals, hits that resume from them, forks, the budget and the cap.

use pagedkv::{Attention, Config, Error, HybridManager, Plan, StateConfig};

const BS: u32 = 16;

fn manager(num_blocks: u32, state: StateConfig) -> HybridManager {
    let mut config = Config::new(num_blocks, BS);
    config.num_cpu_blocks = num_blocks;
    config.hash_key = Some([5; 32]);
    config.watermark = 0.0;
    HybridManager::with_state(config, &[Attention::Full], Some(state)).unwrap()
}

fn state(num_slots: u32, max_checkpoints: u32) -> StateConfig {
    StateConfig {
        num_slots,
        max_checkpoints,
        checkpoint_interval: 0,
        checkpoints_per_sequence: 1,
        num_cpu_slots: 4,
    }
}

/// Admits `seq` with `prompt`, plans and commits its prefill; returns the tokens reused and
/// the prefill's plan.
fn prefill(mgr: &HybridManager, seq: u64, prompt: &[u32]) -> (usize, Plan) {
    let reused = mgr.allocate(seq, prompt, None).unwrap();
    let mut plans = vec![Plan::new()];
    mgr.plan(&[seq], &[(prompt.len() - reused) as u32], &mut plans)
        .unwrap();
    mgr.commit(&[seq], None).unwrap();
    mgr.check().unwrap();
    (reused, plans.remove(0))
}

fn system_prompt() -> Vec<u32> {
    (1000..1900).collect()
}

fn with_message(message: u32) -> Vec<u32> {
    let mut prompt = system_prompt();
    prompt.extend((0..40).map(|i| message * 100 + i));
    prompt
}

/// A 900-token system prompt, then different user messages: the first request saves a
/// checkpoint at its prompt end, the second recomputes the state over the cached KV and saves
/// one where it branched off, at 896 tokens; every later request resumes there.
#[test]
fn requests_after_the_second_resume_from_the_branch_point() {
    let mgr = manager(512, state(8, 4));
    let (reused, plan) = prefill(&mgr, 1, &with_message(1));
    assert_eq!(reused, 0);
    // A new sequence starts from the initial state; its prompt end is saved.
    let working = mgr.state_slot(1).unwrap() as i32;
    assert_eq!(plan.state_slots, vec![working]);
    assert_eq!(plan.state_resets, vec![working]);
    assert!(plan.state_copies.is_empty());
    assert_eq!(plan.state_saves.len(), 3);
    assert_eq!(plan.state_saves[..2], [0, 928]);
    mgr.free(1).unwrap();

    let kv_hits = mgr.stats(0).unwrap().prefix_hit_tokens;
    let (reused, plan) = prefill(&mgr, 2, &with_message(2));
    assert_eq!(reused, 0, "no checkpoint at the branch point yet");
    // The KV of the shared 896 tokens is reused all the same: the pass recomputes the state
    // over it and writes no KV there (slot -1), then registers its own blocks under it.
    assert_eq!(mgr.stats(0).unwrap().prefix_hit_tokens - kv_hits, 896);
    assert_eq!(plan.positions.len(), 940);
    assert!(plan.slot_mapping[..896].iter().all(|&slot| slot == -1));
    assert!(plan.slot_mapping[896..].iter().all(|&slot| slot >= 0));
    // Saves at the branch point (896) and at the prompt end (928).
    let saves: Vec<i32> = plan.state_saves.chunks(3).map(|s| s[1]).collect();
    assert_eq!(saves, vec![896, 928]);
    mgr.free(2).unwrap();

    for seq in 3..8 {
        let (reused, plan) = prefill(&mgr, seq, &with_message(seq as u32));
        assert_eq!(reused, 896, "request {seq}");
        let working = mgr.state_slot(seq).unwrap() as i32;
        assert_eq!(plan.state_copies[1], working);
        assert!(plan.state_resets.is_empty());
        mgr.free(seq).unwrap();
    }
    let stats = mgr.state_stats().unwrap();
    assert_eq!(stats.prefix_hit_tokens, 5 * 896);
    assert!(stats.num_checkpoints <= 4);
    mgr.check().unwrap();
}

/// A hit copies the checkpoint into the working slot before the pass; the checkpoint is
/// pinned until a plan hands that copy out, and evictable again after.
#[test]
fn a_hit_copies_its_checkpoint_before_the_pass() {
    let mgr = manager(256, state(4, 2));
    let prompt: Vec<u32> = (0..64).collect();
    prefill(&mgr, 1, &prompt);
    mgr.free(1).unwrap();
    let mut longer = prompt.clone();
    longer.extend(100..110);
    assert_eq!(mgr.allocate(2, &longer, None).unwrap(), 64);
    let mut plans = vec![Plan::new()];
    mgr.plan(&[2], &[10], &mut plans).unwrap();
    let plan = &plans[0];
    let working = mgr.state_slot(2).unwrap() as i32;
    assert_eq!(plan.state_copies.len(), 2);
    assert_eq!(plan.state_copies[1], working);
    assert_eq!(plan.state_slots, vec![working]);
    mgr.check().unwrap();
}

/// A fork's child starts from a copy of its parent's state, handed out by the next plan.
#[test]
fn a_fork_copies_the_parents_state() {
    let mgr = manager(256, state(4, 1));
    let prompt: Vec<u32> = (0..20).collect();
    prefill(&mgr, 1, &prompt);
    mgr.fork(1, 2).unwrap();
    let (parent, child) = (mgr.state_slot(1).unwrap(), mgr.state_slot(2).unwrap());
    assert_ne!(parent, child);
    let mut plans = vec![Plan::new()];
    mgr.step(&[1, 2], &[7, 8], &mut plans).unwrap();
    assert_eq!(plans[0].state_copies, vec![parent as i32, child as i32]);
    assert_eq!(plans[0].state_slots, vec![parent as i32, child as i32]);
    mgr.check().unwrap();
    // Freeing the parent before the copy is handed out keeps its slot until then.
    mgr.fork(1, 3).unwrap();
    mgr.free(1).unwrap();
    mgr.check().unwrap();
    mgr.step(&[2, 3], &[9, 9], &mut plans).unwrap();
    assert_eq!(plans[0].state_copies[0], parent as i32);
    mgr.check().unwrap();
}

/// Working slots run out: the admission fails and changes nothing; checkpoints are evicted
/// for working slots first.
#[test]
fn admissions_need_a_slot_and_evict_checkpoints_for_it() {
    let mgr = manager(256, state(3, 2));
    prefill(&mgr, 1, &(0..40).collect::<Vec<u32>>());
    prefill(&mgr, 2, &(100..140).collect::<Vec<u32>>());
    assert_eq!(
        mgr.state_stats().unwrap().num_checkpoints,
        1,
        "budget 2, slot 3 free"
    );
    let before = mgr.stats(0).unwrap();
    prefill(&mgr, 3, &(200..240).collect::<Vec<u32>>());
    let stats = mgr.state_stats().unwrap();
    assert_eq!((stats.num_working, stats.num_free), (3, 0));
    assert!(stats.evictions >= 1);
    match mgr.allocate(4, &(300..340).collect::<Vec<u32>>(), None) {
        Err(Error::OutOfStateSlots { needed: 1, .. }) => {}
        other => panic!("expected OutOfStateSlots, got {other:?}"),
    }
    assert!(!mgr.contains(4));
    assert!(mgr.stats(0).unwrap().num_held >= before.num_held);
    assert!(mgr.fork(1, 5).is_err());
    assert!(!mgr.contains(5));
    mgr.check().unwrap();
}

/// Interval checkpoints during decode: a sequence keeps only its last
/// `checkpoints_per_sequence` of them.
#[test]
fn interval_checkpoints_are_capped_per_sequence() {
    let mut config = state(8, 6);
    config.checkpoint_interval = 32;
    config.checkpoints_per_sequence = 2;
    let mgr = manager(256, config);
    prefill(&mgr, 1, &(0..10).collect::<Vec<u32>>());
    let mut plans = vec![Plan::new()];
    let mut saved_at = Vec::new();
    for t in 10..140u32 {
        mgr.step(&[1], &[t], &mut plans).unwrap();
        if !plans[0].state_saves.is_empty() {
            saved_at.push(t + 1);
        }
    }
    mgr.commit(&[1], None).unwrap();
    // The prompt's end (0: under a block) gives none; the intervals give 32, 64, 96, 128.
    assert_eq!(saved_at, vec![32, 64, 96, 128]);
    let stats = mgr.state_stats().unwrap();
    assert_eq!(
        (stats.saved, stats.dropped, stats.num_checkpoints),
        (4, 2, 2)
    );
    mgr.check().unwrap();
    // What was kept resumes a longer prompt at 128 tokens.
    mgr.free(1).unwrap();
    let mut prompt: Vec<u32> = (0..140).collect();
    prompt.push(7);
    assert_eq!(mgr.cached_prefix_blocks(&prompt, None), 8);
}

#[test]
fn bad_state_configs_name_the_field() {
    let make = |state: StateConfig| {
        HybridManager::with_state(Config::new(64, BS), &[Attention::Full], Some(state))
    };
    let cases = [
        (state(0, 0), "state.num_slots"),
        (state(4, 4), "state.max_checkpoints"),
        (
            StateConfig {
                checkpoint_interval: 24,
                ..state(4, 2)
            },
            "state.checkpoint_interval",
        ),
    ];
    for (config, field) in cases {
        match make(config) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains(field), "{msg}"),
            other => panic!("expected an error naming {field}, got {:?}", other.is_ok()),
        }
    }
}

/// Loads from an external store are refused (it holds no states), changing nothing.
#[test]
fn loads_are_refused_with_a_state_group() {
    let mgr = manager(64, state(4, 2));
    prefill(&mgr, 1, &(0..20).collect::<Vec<u32>>());
    assert!(matches!(
        mgr.allocate_loading(2, &[1, 2, 3], 0, None),
        Err(Error::InvalidArgument(_))
    ));
    assert!(!mgr.contains(2));
    mgr.check().unwrap();
}

/// A speculative pass keeps the state after each token but the last (draft states, saved like
/// checkpoints); a rollback makes the one it ends at the working state and frees the rest;
/// the next pass frees what is left. A rollback past the kept states, or of a pass that kept
/// none, is refused, changing nothing.
#[test]
fn a_rollback_restores_the_state_of_the_last_accepted_token() {
    let mgr = manager(64, state(8, 2));
    prefill(&mgr, 1, &(0..20).collect::<Vec<u32>>());
    let working = mgr.state_slot(1).unwrap();
    let mut batches = vec![pagedkv::Batch::new()];
    batches[0].add(1).unwrap();
    // The last sampled token and three drafts: states after 21, 22 and 23 tokens kept.
    mgr.verify_batch(&mut batches, &[7, 8, 9, 10], &[4])
        .unwrap();
    let saves: Vec<Vec<i32>> = (batches[0].inputs().state_saves.chunks(3))
        .map(<[i32]>::to_vec)
        .collect();
    assert_eq!(saves.iter().map(|s| s[1]).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(batches[0].inputs().state_slots, [working as i32]);
    assert_eq!(mgr.state_stats().unwrap().num_drafts, 3);
    mgr.check().unwrap();
    // One draft rejected: back to the state after 23 tokens.
    let kept = saves[2][2] as u32;
    mgr.rollback_batch(&mut batches, &[1]).unwrap();
    assert_eq!(mgr.state_slot(1).unwrap(), kept);
    assert_eq!(mgr.num_tokens(1).unwrap(), 23);
    assert_eq!(mgr.state_stats().unwrap().num_drafts, 2);
    mgr.check().unwrap();
    // Back to 21 tokens as well (two more drafts dropped), but not to 20: that state is gone.
    assert!(matches!(
        mgr.rollback(&[1], &[3]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(mgr.num_tokens(1).unwrap(), 23);
    mgr.rollback(&[1], &[2]).unwrap();
    assert_eq!(mgr.state_slot(1).unwrap(), saves[0][2] as u32);
    assert_eq!(mgr.state_stats().unwrap().num_drafts, 0);
    mgr.check().unwrap();
    // The next pass starts there; a plain pass keeps no draft state to roll back to.
    mgr.step_batch(&mut batches, &[11]).unwrap();
    assert!(batches[0].inputs().state_saves.is_empty());
    assert!(matches!(
        mgr.rollback(&[1], &[1]),
        Err(Error::InvalidArgument(_))
    ));
    mgr.check().unwrap();
}

/// Draft states need slots: a speculative pass that cannot have them is refused before any
/// group changes (it wins over the KV pool), and `plan` checks its draft counts.
#[test]
fn draft_states_need_slots() {
    let mgr = manager(64, state(3, 1));
    prefill(&mgr, 1, &(0..20).collect::<Vec<u32>>());
    prefill(&mgr, 2, &(100..120).collect::<Vec<u32>>());
    mgr.append(1, &[1, 2, 3]).unwrap();
    let mut plans = vec![Plan::new()];
    let err = mgr.plan_with_drafts(&[1], &[3], &[2], &mut plans);
    assert!(matches!(
        err,
        Err(Error::OutOfStateSlots {
            needed: 2,
            available: 1
        })
    ));
    assert_eq!(mgr.state_stats().unwrap().num_drafts, 0);
    for (drafts, q) in [(&[3u32][..], 3u32), (&[1, 1][..], 3)] {
        assert!(matches!(
            mgr.plan_with_drafts(&[1], &[q], drafts, &mut plans),
            Err(Error::InvalidArgument(_))
        ));
    }
    mgr.plan_with_drafts(&[1], &[3], &[1], &mut plans).unwrap();
    assert_eq!(mgr.state_stats().unwrap().num_drafts, 1);
    mgr.check().unwrap();
}

/// A swap moves the state with the KV: `[gpu, cpu]` pairs as one more entry after the
/// groups', the GPU slot released at the confirmation; back in, a new working slot.
#[test]
fn swaps_move_the_state_with_the_kv() {
    let mgr = manager(64, state(3, 1));
    prefill(&mgr, 1, &(0..20).collect::<Vec<u32>>());
    let gpu = mgr.state_slot(1).unwrap();
    let out = mgr.swap_out(&[1]).unwrap();
    assert_eq!(out.len(), 2);
    let cpu = out[1][0][1];
    assert_eq!(out[1], vec![[gpu, cpu]]);
    mgr.confirm_swap_out(&[1]).unwrap();
    assert!(mgr.state_slot(1).is_err(), "no GPU slot while swapped out");
    let stats = mgr.state_stats().unwrap();
    assert_eq!((stats.num_working, stats.num_cpu_free), (0, 3));
    mgr.check().unwrap();
    // Every GPU slot taken by others: the swap-in fails and changes nothing.
    prefill(&mgr, 2, &(100..120).collect::<Vec<u32>>());
    prefill(&mgr, 3, &(200..220).collect::<Vec<u32>>());
    prefill(&mgr, 4, &(300..320).collect::<Vec<u32>>());
    assert!(matches!(
        mgr.swap_in(&[1]),
        Err(Error::OutOfStateSlots { needed: 1, .. })
    ));
    mgr.check().unwrap();
    mgr.free(4).unwrap();
    let back = mgr.swap_in(&[1]).unwrap();
    let working = mgr.state_slot(1).unwrap();
    assert_eq!(back[1], vec![[cpu, working]]);
    mgr.confirm_swap_in(&[1]).unwrap();
    assert_eq!(mgr.state_stats().unwrap().num_cpu_free, 4);
    let mut plans = vec![Plan::new()];
    mgr.step(&[1], &[9], &mut plans).unwrap();
    assert_eq!(plans[0].state_slots, vec![working as i32]);
    mgr.check().unwrap();
}

/// A sequence whose state the next plan still copies or resets cannot swap out yet; out of
/// CPU slots, a swap-out fails; both change nothing.
#[test]
fn swap_outs_wait_for_queued_state_and_cpu_slots() {
    let mut config = state(8, 4);
    config.num_cpu_slots = 1;
    let mgr = manager(64, config);
    mgr.allocate(1, &(0..20).collect::<Vec<u32>>(), None)
        .unwrap();
    assert!(matches!(mgr.swap_out(&[1]), Err(Error::InvalidArgument(_))));
    let mut plans = vec![Plan::new()];
    mgr.plan(&[1], &[20], &mut plans).unwrap();
    prefill(&mgr, 2, &(100..120).collect::<Vec<u32>>());
    assert!(matches!(
        mgr.swap_out(&[1, 2]),
        Err(Error::OutOfStateSlots {
            needed: 2,
            available: 1
        })
    ));
    mgr.swap_out(&[1]).unwrap();
    mgr.check().unwrap();
}

/// The engine's state tensors, modelled: each slot holds the tokens its state summarizes.
struct Engine {
    slots: Vec<Vec<u32>>,
}

impl Engine {
    /// Runs a plan: copies, resets, then each row's pass (its working state must summarize
    /// exactly the tokens before its query), saving where the plan says.
    fn run(&mut self, plan: &Plan, rows: &[(u64, Vec<u32>)]) {
        for pair in plan.state_copies.chunks(2) {
            self.slots[pair[1] as usize] = self.slots[pair[0] as usize].clone();
        }
        for &slot in &plan.state_resets {
            self.slots[slot as usize].clear();
        }
        for (row, (seq, tokens)) in rows.iter().enumerate() {
            let working = plan.state_slots[row] as usize;
            let (start, end) = (
                plan.positions[plan.qo_indptr[row] as usize] as usize,
                plan.qo_indptr[row + 1] - plan.qo_indptr[row],
            );
            let end = start + end as usize;
            assert_eq!(
                self.slots[working],
                tokens[..start],
                "sequence {seq}'s state before its pass"
            );
            for save in plan.state_saves.chunks(3).filter(|s| s[0] as usize == row) {
                self.slots[save[2] as usize] = tokens[..start + save[1] as usize].to_vec();
            }
            self.slots[working] = tokens[..end].to_vec();
        }
    }
}

/// Random admissions (prompts sharing prefixes), decode steps, speculative passes and their
/// rollbacks, forks, frees, swaps and cache resets on a tight state pool, with full attention alone (the KV reused past the state's
/// checkpoint) or beside a window, run against a model of the engine's state tensors: every
/// pass starts from the state of exactly the tokens before it, whether it came from a reset,
/// a checkpoint hit, a fork or a swap.
#[test]
fn random_operations_keep_every_state_exact() {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let (mut resumed, mut moved, mut speculated) = (0, 0, 0);
    for round in 0..20 {
        let mut config = state(6 + round % 4, 3);
        config.checkpoint_interval = if round % 2 == 0 { 0 } else { 32 };
        config.checkpoints_per_sequence = 1 + round % 2;
        config.num_cpu_slots = 2;
        let mut hybrid_config = Config::new(400, BS);
        hybrid_config.hash_key = Some([round as u8; 32]);
        hybrid_config.watermark = 0.0;
        hybrid_config.num_cpu_blocks = 400;
        let groups = [Attention::Full, Attention::SlidingWindow(24)];
        let groups = &groups[..1 + round as usize % 2];
        let mgr = HybridManager::with_state(hybrid_config, groups, Some(config)).unwrap();
        let mut engine = Engine {
            slots: vec![Vec::new(); 16],
        };
        let mut cpu: Vec<Vec<u32>> = vec![Vec::new(); 2];
        let mut live: Vec<(u64, Vec<u32>)> = Vec::new();
        let mut swapped: Vec<(u64, Vec<u32>)> = Vec::new();
        let mut plans: Vec<Plan> = groups.iter().map(|_| Plan::new()).collect();
        let mut id = 0;
        for _ in 0..300 {
            match next(14) {
                0..=2 => {
                    // Prompts branch off three stems at random lengths.
                    let stem = next(3) as u32;
                    let mut prompt: Vec<u32> =
                        (0..next(120) as u32 + 1).map(|i| stem * 1000 + i).collect();
                    prompt.extend((0..next(20)).map(|_| 5000 + next(4) as u32));
                    id += 1;
                    let Ok(reused) = mgr.allocate(id, &prompt, None) else {
                        continue;
                    };
                    let q = (prompt.len() - reused) as u32;
                    mgr.plan(&[id], &[q], &mut plans).unwrap();
                    let rows = vec![(id, prompt)];
                    engine.run(&plans[0], &rows);
                    live.extend(rows);
                }
                3..=5 if !live.is_empty() => {
                    let seqs: Vec<u64> = live.iter().map(|(s, _)| *s).collect();
                    let tokens: Vec<u32> = seqs.iter().map(|_| next(4) as u32).collect();
                    if mgr.step(&seqs, &tokens, &mut plans).is_err() {
                        continue;
                    }
                    for ((_, t), &token) in live.iter_mut().zip(&tokens) {
                        t.push(token);
                    }
                    engine.run(&plans[0], &live);
                }
                6 if !live.is_empty() => {
                    let parent = live[next(live.len() as u64) as usize].clone();
                    id += 1;
                    if mgr.fork(parent.0, id).is_ok() {
                        live.push((id, parent.1));
                    }
                }
                7 | 8 if !live.is_empty() => {
                    let (seq, _) = live.remove(next(live.len() as u64) as usize);
                    mgr.free(seq).unwrap();
                }
                9 if next(8) == 0 => mgr.reset_prefix_cache(),
                10 if !live.is_empty() => {
                    let i = next(live.len() as u64) as usize;
                    let Ok(pairs) = mgr.swap_out(&[live[i].0]) else {
                        continue;
                    };
                    for &[gpu, c] in pairs.last().unwrap() {
                        cpu[c as usize] = engine.slots[gpu as usize].clone();
                    }
                    mgr.confirm_swap_out(&[live[i].0]).unwrap();
                    swapped.push(live.remove(i));
                    moved += 1;
                }
                12 | 13 if !live.is_empty() => {
                    // A speculative pass: the last sampled token and `k` drafts, then the
                    // rejected drafts rolled back (a failed plan rolls back all it appended).
                    let i = next(live.len() as u64) as usize;
                    let (seq, k) = (live[i].0, next(4) as u32);
                    let tokens: Vec<u32> = (0..=k).map(|_| next(4) as u32).collect();
                    if mgr.append(seq, &tokens).is_err() {
                        continue;
                    }
                    if mgr
                        .plan_with_drafts(&[seq], &[k + 1], &[k], &mut plans)
                        .is_err()
                    {
                        mgr.rollback(&[seq], &[k as usize + 1]).unwrap();
                        continue;
                    }
                    live[i].1.extend(&tokens);
                    engine.run(&plans[0], &live[i..=i]);
                    let rejected = next(u64::from(k) + 1) as usize;
                    mgr.rollback(&[seq], &[rejected]).unwrap();
                    let len = live[i].1.len() - rejected;
                    live[i].1.truncate(len);
                    speculated += 1;
                }
                11 if !swapped.is_empty() => {
                    let i = next(swapped.len() as u64) as usize;
                    let Ok(pairs) = mgr.swap_in(&[swapped[i].0]) else {
                        continue;
                    };
                    for &[c, gpu] in pairs.last().unwrap() {
                        engine.slots[gpu as usize] = cpu[c as usize].clone();
                    }
                    mgr.confirm_swap_in(&[swapped[i].0]).unwrap();
                    live.push(swapped.remove(i));
                }
                _ => {}
            }
            mgr.check().unwrap();
        }
        resumed += mgr.state_stats().unwrap().prefix_hit_tokens;
    }
    assert!(resumed > 0, "no admission resumed from a checkpoint");
    assert!(moved > 0, "no state was swapped");
    assert!(speculated > 0, "no speculative pass ran");
}

/// A working state already holds the planned tokens: a plan covering them again is refused,
/// changing nothing.
#[test]
fn a_plan_must_start_where_the_planned_tokens_end() {
    let mgr = manager(64, state(4, 2));
    let prompt: Vec<u32> = (0..20).collect();
    mgr.allocate(1, &prompt, None).unwrap();
    let mut plans = vec![Plan::new()];
    mgr.plan(&[1], &[20], &mut plans).unwrap();
    match mgr.plan(&[1], &[4], &mut plans) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("state group"), "{msg}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(plans[0].state_slots.is_empty());
    mgr.append(1, &[7, 8]).unwrap();
    mgr.plan(&[1], &[2], &mut plans).unwrap();
    assert_eq!(
        plans[0].state_slots,
        vec![mgr.state_slot(1).unwrap() as i32]
    );
    mgr.check().unwrap();
}

/// A next turn whose state resumes before its KV hit (no checkpoint where the KV ends) reuses
/// the KV all the same, so its blocks extend the cached chain exactly as without a state group
/// (recomputing the KV instead would duplicate cached blocks, and a duplicate's sequence
/// registers nothing after it: SEMANTICS.md, "One tree").
#[test]
fn a_state_recompute_reuses_and_extends_the_cached_kv() {
    let run = |state: Option<StateConfig>| {
        let mut config = Config::new(1000, BS);
        config.hash_key = Some([5; 32]);
        let mgr = HybridManager::with_state(config, &[Attention::Full], state).unwrap();
        prefill(&mgr, 1, &(0..100).collect::<Vec<u32>>());
        let mut plans = vec![Plan::new()];
        for t in 0..40 {
            mgr.step(&[1], &[500 + t], &mut plans).unwrap();
        }
        let mut next = mgr.tokens(1).unwrap();
        mgr.free(1).unwrap();
        next.extend(900..960);
        let kv_before = mgr.stats(0).unwrap().prefix_hit_tokens;
        let (reused, plan) = prefill(&mgr, 2, &next);
        let kv_hit = mgr.stats(0).unwrap().prefix_hit_tokens - kv_before;
        let unwritten = plan.slot_mapping.iter().filter(|&&slot| slot == -1).count();
        let stored = mgr.stored_hashes(pagedkv::PoolKind::Gpu).len();
        (reused, kv_hit, unwritten, stored)
    };
    // The first turn's 139 computed tokens left 8 full blocks: the KV hit is 128 tokens.
    assert_eq!(run(None), (128, 128, 0, 12));
    // The state's checkpoint is at the first prompt's end (96): it recomputes 96..128 over
    // the cached KV (those 32 slots -1), and all 12 blocks are cached after.
    assert_eq!(run(Some(state(8, 4))), (96, 128, 32, 12));
}

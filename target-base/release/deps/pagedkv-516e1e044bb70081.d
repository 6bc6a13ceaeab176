/work/main/target-base/release/deps/pagedkv-516e1e044bb70081.d: rust/core/src/lib.rs rust/core/src/batch.rs rust/core/src/block.rs rust/core/src/bookkeeping.rs rust/core/src/config.rs rust/core/src/cpu_tier.rs rust/core/src/error.rs rust/core/src/events.rs rust/core/src/free_list.rs rust/core/src/lru.rs rust/core/src/manager.rs rust/core/src/manager/admission.rs rust/core/src/manager/audit.rs rust/core/src/manager/fork.rs rust/core/src/manager/lifecycle.rs rust/core/src/manager/step.rs rust/core/src/manager/swap.rs rust/core/src/plan.rs rust/core/src/pool.rs rust/core/src/prefix.rs rust/core/src/sequence.rs rust/core/src/stats.rs rust/core/src/sync.rs

/work/main/target-base/release/deps/libpagedkv-516e1e044bb70081.rlib: rust/core/src/lib.rs rust/core/src/batch.rs rust/core/src/block.rs rust/core/src/bookkeeping.rs rust/core/src/config.rs rust/core/src/cpu_tier.rs rust/core/src/error.rs rust/core/src/events.rs rust/core/src/free_list.rs rust/core/src/lru.rs rust/core/src/manager.rs rust/core/src/manager/admission.rs rust/core/src/manager/audit.rs rust/core/src/manager/fork.rs rust/core/src/manager/lifecycle.rs rust/core/src/manager/step.rs rust/core/src/manager/swap.rs rust/core/src/plan.rs rust/core/src/pool.rs rust/core/src/prefix.rs rust/core/src/sequence.rs rust/core/src/stats.rs rust/core/src/sync.rs

/work/main/target-base/release/deps/libpagedkv-516e1e044bb70081.rmeta: rust/core/src/lib.rs rust/core/src/batch.rs rust/core/src/block.rs rust/core/src/bookkeeping.rs rust/core/src/config.rs rust/core/src/cpu_tier.rs rust/core/src/error.rs rust/core/src/events.rs rust/core/src/free_list.rs rust/core/src/lru.rs rust/core/src/manager.rs rust/core/src/manager/admission.rs rust/core/src/manager/audit.rs rust/core/src/manager/fork.rs rust/core/src/manager/lifecycle.rs rust/core/src/manager/step.rs rust/core/src/manager/swap.rs rust/core/src/plan.rs rust/core/src/pool.rs rust/core/src/prefix.rs rust/core/src/sequence.rs rust/core/src/stats.rs rust/core/src/sync.rs

rust/core/src/lib.rs:
rust/core/src/batch.rs:
rust/core/src/block.rs:
rust/core/src/bookkeeping.rs:
rust/core/src/config.rs:
rust/core/src/cpu_tier.rs:
rust/core/src/error.rs:
rust/core/src/events.rs:
rust/core/src/free_list.rs:
rust/core/src/lru.rs:
rust/core/src/manager.rs:
rust/core/src/manager/admission.rs:
rust/core/src/manager/audit.rs:
rust/core/src/manager/fork.rs:
rust/core/src/manager/lifecycle.rs:
rust/core/src/manager/step.rs:
rust/core/src/manager/swap.rs:
rust/core/src/plan.rs:
rust/core/src/pool.rs:
rust/core/src/prefix.rs:
rust/core/src/sequence.rs:
rust/core/src/stats.rs:
rust/core/src/sync.rs:

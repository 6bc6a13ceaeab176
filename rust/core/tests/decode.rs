//! Decode steps through the public API: one-shot plans, persistent batches, verify steps and
//! rollbacks, against each other and across the other operations.

use pagedkv::{Batch, BlockManager, Config, Error, EventKind, Plan, SeqId, Token};

fn manager(num_blocks: u32, block_size: u32, edit: impl FnOnce(&mut Config)) -> BlockManager {
    let mut config = Config::new(num_blocks, block_size);
    config.watermark = 0.0;
    edit(&mut config);
    BlockManager::new(config).unwrap()
}

/// Plans every uncomputed token of each sequence (a prefill), returning the plan.
fn prefill(mgr: &BlockManager, seqs: &[SeqId]) -> Plan {
    let lens: Vec<u32> = seqs
        .iter()
        .map(|&s| (mgr.num_tokens(s).unwrap() - mgr.num_computed(s).unwrap()) as u32)
        .collect();
    let mut plan = Plan::new();
    mgr.plan(seqs, &lens, &mut plan).unwrap();
    mgr.check().unwrap();
    plan
}

fn is_invalid<T: std::fmt::Debug>(result: Result<T, Error>) -> bool {
    matches!(result, Err(Error::InvalidArgument(_)))
}

#[test]
fn a_failed_plan_leaves_it_empty() {
    let mgr = BlockManager::new(Config::new(8, 4)).unwrap();
    mgr.allocate(1, &[1, 2, 3], None).unwrap();
    let mut plan = Plan::new();
    mgr.plan(&[1], &[3], &mut plan).unwrap();
    assert_eq!(plan.batch_size(), 1);
    assert!(mgr.plan(&[1], &[4], &mut plan).is_err());
    assert_eq!(plan.batch_size(), 0);
    mgr.step(&[1], &[4], &mut plan).unwrap();
    assert_eq!(plan.positions, vec![3]);
    assert_eq!(
        mgr.step(&[2], &[4], &mut plan),
        Err(Error::UnknownSequence(2))
    );
    assert_eq!(plan.batch_size(), 0);
    assert!(plan.block_tables().unwrap().is_empty());
    mgr.check().unwrap();
}

/// An operation on a manager, between two steps of a batch.
type Op = fn(&BlockManager);

/// A persistent batch, which writes only the table entries that changed, decides exactly
/// as a new batch whatever other operations run between its steps.
#[test]
fn a_kept_batch_decides_as_a_new_one() {
    let ops: [(&str, Op); 14] = [
        ("nothing", |_| {}),
        ("nothing again", |_| {}),
        ("append", |m| m.append(2, &[7]).unwrap()),
        ("plan the append", |m| {
            prefill(m, &[2]);
        }),
        ("fork", |m| m.fork(1, 9).unwrap()),
        ("free the fork", |m| m.free(9).unwrap()),
        ("swap out", |m| drop(m.swap_out(&[3]).unwrap())),
        ("confirm it", |m| m.confirm_swap_out(&[3]).unwrap()),
        ("swap in", |m| {
            m.swap_in(&[3]).unwrap();
            m.confirm_swap_in(&[3]).unwrap();
        }),
        ("replace", |m| {
            m.free(2).unwrap();
            m.allocate(2, &[5, 6, 7, 8, 9], None).unwrap();
            prefill(m, &[2]);
        }),
        ("replan", |m| {
            let mut plan = Plan::new();
            m.plan(&[1], &[2], &mut plan).unwrap();
        }),
        ("commit", |m| m.commit(&[1, 2, 3], None).unwrap()),
        ("reset", |m| m.reset_prefix_cache()),
        ("nothing at last", |_| {}),
    ];
    // Without prefix caching, and with it; each operation runs at several offsets into a
    // block.
    for (caching, steps) in [(false, 3), (false, 5), (true, 3), (true, 5)] {
        kept_decides_as_fresh(&ops, caching, steps);
    }
}

/// [`a_kept_batch_decides_as_a_new_one`] with `steps` steps after each operation.
fn kept_decides_as_fresh(ops: &[(&str, Op)], caching: bool, steps: usize) {
    let managers = [(); 2].map(|_| {
        let m = manager(64, 4, |c| {
            c.num_cpu_blocks = 32;
            c.enable_prefix_caching = caching;
        });
        for seq in 1..=3 {
            m.allocate(seq, &[seq as Token; 6], None).unwrap();
        }
        prefill(&m, &[1, 2, 3]);
        m
    });
    let [kept_mgr, fresh_mgr] = &managers;
    let mut kept = Batch::new();
    for seq in 1..=3 {
        kept.add(seq).unwrap();
    }
    let mut token = 100;
    for &(name, op) in ops {
        for step in 0..steps {
            if step == 0 {
                op(kept_mgr);
                op(fresh_mgr);
            }
            token += 1;
            let mut fresh = Batch::new();
            for &seq in kept.seqs() {
                fresh.add(seq).unwrap();
            }
            let tokens = [token; 3];
            let (a, b) = (
                kept_mgr.step_batch(&mut kept, &tokens),
                fresh_mgr.step_batch(&mut fresh, &tokens),
            );
            assert_eq!(a, b, "{name}, step {step}, caching {caching}");
            let (mut pa, mut pb) = (Plan::new(), Plan::new());
            kept.write_plan(&mut pa);
            fresh.write_plan(&mut pb);
            if a.is_ok() {
                assert_eq!(pa, pb, "{name}, step {step}, caching {caching}");
            }
            kept_mgr.check().unwrap();
            fresh_mgr.check().unwrap();
        }
    }
    assert_eq!(kept_mgr.stats(), fresh_mgr.stats());
}

/// The blocks a decode step registers publish the hashes `block_hashes` computes.
#[test]
fn blocks_hashed_together_publish_their_hashes() {
    let mgr = manager(256, 16, |c| c.enable_events = true);
    let seqs: Vec<SeqId> = (1..=11).collect();
    let prompts: Vec<Vec<Token>> = seqs
        .iter()
        .map(|&seq| (0..31).map(|t| (seq as Token) * 1000 + t).collect())
        .collect();
    for (&seq, prompt) in seqs.iter().zip(&prompts) {
        mgr.allocate(seq, prompt, None).unwrap();
    }
    let mut batch = Batch::new();
    for &seq in &seqs {
        batch.add(seq).unwrap();
    }
    prefill(&mgr, &seqs);
    // The first step commits the prefill (block 0 of each); the one token it adds fills
    // block 1, which the next step registers.
    for token in [5, 6] {
        mgr.step_batch(&mut batch, &vec![token; seqs.len()])
            .unwrap();
    }
    let published: std::collections::HashMap<_, _> = (mgr.take_events().into_iter())
        .filter_map(|event| match event.kind {
            EventKind::BlockStored {
                block_id,
                block_hash,
                ..
            } => Some((block_id, block_hash)),
            _ => None,
        })
        .collect();
    for (&seq, prompt) in seqs.iter().zip(&prompts) {
        let tokens: Vec<Token> = prompt.iter().copied().chain([5]).collect();
        let table = mgr.block_table(seq).unwrap();
        let hashes: Vec<_> = table[..2].iter().map(|b| published[b]).collect();
        assert_eq!(
            hashes,
            mgr.block_hashes(&tokens, None).unwrap(),
            "sequence {seq}"
        );
    }
    mgr.check().unwrap();
}

/// A batch stepped on one manager and then on another mirrors each manager's tables.
#[test]
fn a_batch_on_another_manager_checks_every_row() {
    let [first, second] = [(); 2].map(|_| {
        let m = manager(16, 4, |c| c.num_cpu_blocks = 8);
        m.allocate(1, &[1, 2, 3, 4, 5], None).unwrap();
        prefill(&m, &[1]);
        m
    });
    let mut batch = Batch::new();
    batch.add(1).unwrap();
    first.step_batch(&mut batch, &[6]).unwrap();
    second.swap_out(&[1]).unwrap();
    assert_eq!(
        second.step_batch(&mut batch, &[7]),
        Err(Error::SwappedOut(1))
    );
    first.step_batch(&mut batch, &[7]).unwrap();
    assert_eq!(first.num_tokens(1).unwrap(), 7);
    first.check().unwrap();
    second.check().unwrap();
}

#[test]
fn queries_may_not_skip_unplanned_tokens() {
    let mgr = manager(16, 4, |_| {});
    mgr.allocate(1, &(1..=9).collect::<Vec<_>>(), None).unwrap();
    let mut plan = Plan::new();
    assert!(is_invalid(mgr.step(&[1], &[10], &mut plan)));
    assert!(is_invalid(mgr.plan(&[1], &[1], &mut plan)));
    assert!(is_invalid(mgr.plan(&[1], &[5], &mut plan)));
    assert_eq!(mgr.num_tokens(1).unwrap(), 9);
    assert_eq!(plan.batch_size(), 0);
    mgr.check().unwrap();
    // A chunked prefill: the first chunk, then the rest.
    mgr.plan(&[1], &[9], &mut plan).unwrap();
    mgr.append(1, &[10, 11, 12]).unwrap();
    assert!(is_invalid(mgr.plan(&[1], &[1], &mut plan)));
    assert!(is_invalid(mgr.step(&[1], &[13], &mut plan)));
    mgr.plan(&[1], &[3], &mut plan).unwrap();
    assert_eq!(plan.positions, vec![9, 10, 11]);
    mgr.step(&[1], &[13], &mut plan).unwrap();
    assert_eq!(plan.positions, vec![12]);
    // Re-planning already planned tokens is allowed (a recomputation); its auto-commit
    // confirms the step before it.
    mgr.plan(&[1], &[13], &mut plan).unwrap();
    assert_eq!(mgr.num_computed(1).unwrap(), 13);
    mgr.check().unwrap();
}

/// A rollback leaves the sequence, its blocks and the pool as if only the kept tokens had
/// been appended.
#[test]
fn a_rollback_undoes_the_rejected_appends() {
    let [rolled, plain] = [(); 2].map(|_| manager(16, 4, |_| {}));
    let prompt: Vec<Token> = (1..=6).collect();
    for mgr in [&rolled, &plain] {
        mgr.allocate(1, &prompt, None).unwrap();
        prefill(mgr, &[1]);
    }
    rolled.append(1, &[7, 8, 9, 10, 11]).unwrap();
    let mut plan = Plan::new();
    rolled.plan(&[1], &[5], &mut plan).unwrap();
    rolled.rollback(&[1], &[3]).unwrap();
    plain.append(1, &[7, 8]).unwrap();
    plain.plan(&[1], &[2], &mut plan).unwrap();
    for mgr in [&rolled, &plain] {
        assert_eq!(mgr.tokens(1).unwrap(), (1..=8).collect::<Vec<_>>());
        assert_eq!(mgr.block_table(1).unwrap(), vec![0, 1]);
        mgr.check().unwrap();
    }
    assert_eq!(rolled.stats(), plain.stats());
    // The block a rollback freed is the next one taken.
    rolled.append(1, &[9]).unwrap();
    assert_eq!(rolled.block_table(1).unwrap(), vec![0, 1, 2]);
}

#[test]
fn committed_tokens_cannot_be_rolled_back() {
    let mgr = manager(16, 4, |c| c.auto_commit = false);
    mgr.allocate(1, &[1, 2, 3, 4, 5], None).unwrap();
    prefill(&mgr, &[1]);
    mgr.commit(&[1], Some(&[4])).unwrap();
    assert!(is_invalid(mgr.rollback(&[1], &[2])));
    assert!(is_invalid(mgr.rollback(&[1, 1], &[1, 1])));
    assert!(is_invalid(mgr.rollback(&[1], &[1, 1])));
    assert_eq!(mgr.rollback(&[2], &[1]), Err(Error::UnknownSequence(2)));
    assert_eq!(mgr.num_tokens(1).unwrap(), 5);
    mgr.rollback(&[1], &[1]).unwrap();
    assert_eq!(mgr.num_tokens(1).unwrap(), 4);
    mgr.check().unwrap();
    // A sequence keeps at least one token.
    mgr.allocate(3, &[1], None).unwrap();
    assert!(is_invalid(mgr.rollback(&[3], &[1])));
}

/// A batch's rows follow a `rollback_batch` at once, and a plain `rollback` at the next
/// step: either way the table is what a fresh batch would hold.
#[test]
fn batch_rows_follow_a_rollback() {
    for in_batch in [true, false] {
        let mgr = manager(32, 4, |_| {});
        for seq in 1..=2 {
            mgr.allocate(seq, &[1, 2, 3, 4], None).unwrap();
        }
        prefill(&mgr, &[1, 2]);
        let mut batch = Batch::new();
        batch.add(1).unwrap();
        batch.add(2).unwrap();
        mgr.verify_batch(&mut batch, &[5, 6, 7, 8, 9, 9, 9], &[5, 2])
            .unwrap();
        assert_eq!(batch.inputs().qo_indptr, vec![0, 5, 7]);
        if in_batch {
            mgr.rollback_batch(&mut batch, &[4, 0]).unwrap();
        } else {
            mgr.rollback(&[1, 2], &[4, 0]).unwrap();
        }
        // Sequence 2 takes the block sequence 1 dropped.
        mgr.step_batch(&mut batch, &[7, 7]).unwrap();
        let mut fresh = Batch::new();
        fresh.add(1).unwrap();
        fresh.add(2).unwrap();
        mgr.rollback(&[1, 2], &[1, 1]).unwrap();
        mgr.step_batch(&mut fresh, &[7, 7]).unwrap();
        mgr.rollback(&[1, 2], &[1, 1]).unwrap();
        mgr.step_batch(&mut batch, &[7, 7]).unwrap();
        assert_eq!(
            batch.block_table(),
            fresh.block_table(),
            "in batch {in_batch}"
        );
        mgr.check().unwrap();
    }
}

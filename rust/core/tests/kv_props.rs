//! Property tests of the KV page allocator: random operation sequences against a reference
//! model (request id -> length in tokens), checking the pool's invariants after every step.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use specdial_core::kv::{KvError, PagePool};

#[derive(Debug, Clone)]
enum Op {
    Add(u64),
    Reserve(u64, u64),
    /// Truncate to `len - k` (saturating): the usual "drop the rejected tail".
    TruncateBy(u64, u64),
    /// Truncate to an arbitrary length, often past the end (an error).
    TruncateTo(u64, u64),
    Free(u64),
    Slots(u64, u64, u64),
    PagesNeeded(u64, u64),
}

/// Few ids, so that duplicates, unknown ids and double frees all happen.
fn id() -> impl Strategy<Value = u64> {
    0u64..6
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => id().prop_map(Op::Add),
        4 => (id(), 0u64..20).prop_map(|(i, n)| Op::Reserve(i, n)),
        2 => (id(), 0u64..10).prop_map(|(i, k)| Op::TruncateBy(i, k)),
        1 => (id(), 0u64..40).prop_map(|(i, n)| Op::TruncateTo(i, n)),
        1 => id().prop_map(Op::Free),
        1 => (id(), 0u64..40, 0u64..40).prop_map(|(i, s, e)| Op::Slots(i, s, e)),
        1 => (id(), 0u64..40).prop_map(|(i, n)| Op::PagesNeeded(i, n)),
    ]
}

/// Every invariant of the pool, given the reference model of lengths.
fn check_invariants(pool: &PagePool, model: &HashMap<u64, u64>) -> Result<(), TestCaseError> {
    let ps = u64::from(pool.page_size());
    prop_assert_eq!(pool.num_requests(), model.len());
    prop_assert_eq!(
        pool.num_free_pages() + pool.num_used_pages(),
        pool.num_pages()
    );

    let mut owner: HashMap<u32, u64> = HashMap::new();
    let mut all_slots: HashSet<i64> = HashSet::new();
    for (&id, &len) in model {
        prop_assert!(pool.has_request(id));
        prop_assert_eq!(pool.len(id), Ok(len));
        let pages = pool.pages(id).unwrap();
        prop_assert_eq!(pages.len() as u64, len.div_ceil(ps), "request {} pages", id);
        for &p in pages {
            prop_assert!(p < pool.num_pages(), "page {} out of range", p);
            if let Some(other) = owner.insert(p, id) {
                prop_assert!(false, "page {} owned by requests {} and {}", p, other, id);
            }
        }
        let slots = pool.kv_indices(id, 0, len).unwrap();
        prop_assert_eq!(slots.len() as u64, len);
        for (t, &s) in slots.iter().enumerate() {
            let t = t as u64;
            prop_assert!(s >= 0 && (s as u64) < pool.num_kv_slots());
            prop_assert_eq!(s as u64 / ps, u64::from(pages[(t / ps) as usize]));
            prop_assert_eq!(s as u64 % ps, t % ps);
            prop_assert!(all_slots.insert(s), "slot {} handed out twice", s);
        }
    }
    prop_assert_eq!(owner.len() as u32, pool.num_used_pages());
    Ok(())
}

fn run_ops(num_pages: u32, page_size: u32, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut pool = PagePool::new(num_pages, page_size).unwrap();
    let mut model: HashMap<u64, u64> = HashMap::new();
    for op in ops {
        let before = pool.clone();
        let free_before = u64::from(pool.num_free_pages());
        let failed = match *op {
            Op::Add(id) => {
                let r = pool.add_request(id);
                prop_assert_eq!(r.is_err(), model.contains_key(&id));
                if r.is_ok() {
                    model.insert(id, 0);
                } else {
                    prop_assert_eq!(&r, &Err(KvError::DuplicateRequest(id)));
                }
                r.is_err()
            }
            Op::Reserve(id, n) => {
                let can = pool.can_reserve(id, n);
                let needed = pool.pages_needed(id, n);
                match pool.reserve(id, n) {
                    Ok(slots) => {
                        prop_assert!(can);
                        let old = model[&id];
                        prop_assert_eq!(
                            u64::from(pool.num_free_pages()),
                            free_before - needed.unwrap()
                        );
                        model.insert(id, old + n);
                        prop_assert_eq!(slots, pool.kv_indices(id, old, old + n).unwrap());
                        false
                    }
                    Err(e) => {
                        prop_assert!(!can);
                        match e {
                            KvError::UnknownRequest(i) => {
                                prop_assert_eq!(i, id);
                                prop_assert!(!model.contains_key(&id));
                            }
                            KvError::OutOfPages {
                                needed: nd, free, ..
                            } => {
                                prop_assert_eq!(Ok(nd), needed);
                                prop_assert!(nd > u64::from(free));
                            }
                            other => prop_assert!(false, "unexpected error {:?}", other),
                        }
                        true
                    }
                }
            }
            Op::TruncateBy(id, k) => {
                let new_len = model.get(&id).map_or(0, |l| l.saturating_sub(k));
                truncate(&mut pool, &mut model, id, new_len)?
            }
            Op::TruncateTo(id, new_len) => truncate(&mut pool, &mut model, id, new_len)?,
            Op::Free(id) => match pool.free_request(id) {
                Ok(freed) => {
                    let len = model.remove(&id).unwrap();
                    prop_assert_eq!(u64::from(freed), len.div_ceil(u64::from(page_size)));
                    false
                }
                Err(e) => {
                    prop_assert_eq!(e, KvError::UnknownRequest(id));
                    prop_assert!(!model.contains_key(&id));
                    true
                }
            },
            Op::Slots(id, start, end) => {
                let r = pool.kv_indices(id, start, end);
                match model.get(&id) {
                    None => prop_assert_eq!(r, Err(KvError::UnknownRequest(id))),
                    Some(&len) if start <= end && end <= len => {
                        let all = pool.kv_indices(id, 0, len).unwrap();
                        prop_assert_eq!(r.unwrap(), all[start as usize..end as usize].to_vec());
                    }
                    Some(&len) => prop_assert_eq!(
                        r,
                        Err(KvError::InvalidRange {
                            request_id: id,
                            start,
                            end,
                            len
                        })
                    ),
                }
                true // read-only: must not change anything either
            }
            Op::PagesNeeded(id, n) => {
                let r = pool.pages_needed(id, n);
                match model.get(&id) {
                    None => prop_assert_eq!(r, Err(KvError::UnknownRequest(id))),
                    Some(&len) => {
                        let ps = u64::from(page_size);
                        prop_assert_eq!(&r, &Ok((len + n).div_ceil(ps) - len.div_ceil(ps)));
                        prop_assert_eq!(pool.can_reserve(id, n), r.unwrap() <= free_before);
                    }
                }
                true
            }
        };
        if failed {
            prop_assert_eq!(
                &pool,
                &before,
                "a failed or read-only operation changed the pool"
            );
        }
        check_invariants(&pool, &model)?;
    }

    // Freeing every request returns every page.
    let ids: Vec<u64> = model.keys().copied().collect();
    for id in ids {
        pool.free_request(id).unwrap();
        model.remove(&id);
        check_invariants(&pool, &model)?;
    }
    prop_assert_eq!(pool.num_free_pages(), pool.num_pages());
    prop_assert_eq!(pool.num_used_pages(), 0);
    prop_assert_eq!(pool.num_requests(), 0);
    Ok(())
}

/// Truncates and checks the outcome; returns whether it failed.
fn truncate(
    pool: &mut PagePool,
    model: &mut HashMap<u64, u64>,
    id: u64,
    new_len: u64,
) -> Result<bool, TestCaseError> {
    let ps = u64::from(pool.page_size());
    let free_before = pool.num_free_pages();
    let r = pool.truncate(id, new_len);
    match model.get(&id).copied() {
        None => {
            prop_assert_eq!(r, Err(KvError::UnknownRequest(id)));
            Ok(true)
        }
        Some(len) if new_len > len => {
            prop_assert_eq!(
                r,
                Err(KvError::TruncateBeyondLength {
                    request_id: id,
                    new_len,
                    len
                })
            );
            Ok(true)
        }
        Some(len) => {
            let freed = len.div_ceil(ps) - new_len.div_ceil(ps);
            prop_assert_eq!(r, Ok(freed as u32));
            prop_assert_eq!(pool.num_free_pages(), free_before + freed as u32);
            model.insert(id, new_len);
            Ok(false)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_operations_keep_invariants(
        num_pages in 1u32..24,
        page_size in 1u32..6,
        ops in proptest::collection::vec(op(), 0..80),
    ) {
        run_ops(num_pages, page_size, &ops)?;
    }

    /// Speculative decoding pattern: every live request reserves `steps + 1` tokens, then
    /// truncates the rejected tail; after all are freed nothing leaks.
    #[test]
    fn reserve_then_reject_tail_never_leaks(
        page_size in 1u32..9,
        rounds in proptest::collection::vec(
            proptest::collection::vec((0u64..8, 0u64..8), 1..6), 1..20),
    ) {
        let mut pool = PagePool::new(64, page_size).unwrap();
        let mut model = HashMap::new();
        for (id, _) in rounds[0].iter().enumerate() {
            pool.add_request(id as u64).unwrap();
            model.insert(id as u64, 0u64);
        }
        for round in &rounds {
            for (id, &(steps, accepted)) in round.iter().enumerate() {
                let id = id as u64;
                let Some(&len) = model.get(&id) else { continue };
                if !pool.can_reserve(id, steps + 1) {
                    pool.free_request(id).unwrap();
                    model.remove(&id);
                    continue;
                }
                pool.reserve(id, steps + 1).unwrap();
                let keep = len + accepted.min(steps) + 1;
                pool.truncate(id, keep).unwrap();
                model.insert(id, keep);
            }
            check_invariants(&pool, &model)?;
        }
        for id in model.keys() {
            pool.free_request(*id).unwrap();
        }
        prop_assert_eq!(pool.num_free_pages(), 64);
    }

    /// No input panics, however large: every call returns a value or an error.
    #[test]
    fn arbitrary_inputs_never_panic(
        num_pages in any::<u32>(),
        page_size in any::<u32>(),
        calls in proptest::collection::vec((0u8..8, any::<u64>(), any::<u64>(), any::<u64>()), 0..40),
    ) {
        let Ok(mut pool) = PagePool::new(num_pages, page_size) else {
            prop_assert!(
                num_pages == 0
                    || page_size == 0
                    || u64::from(num_pages) * u64::from(page_size) > i64::MAX as u64
            );
            return Ok(());
        };
        for (kind, a, b, c) in calls {
            // Half the ids land on 0..4 so that calls hit registered requests.
            let id = if a % 2 == 0 { a % 4 } else { a };
            // Keep successful reservations small enough to allocate; huge ones must be refused.
            let n = if b % 2 == 0 { b % 64 } else { b };
            let before = pool.clone();
            let failed = match kind {
                0 => pool.add_request(id).is_err(),
                1 => { let _ = pool.can_reserve(id, n); let _ = pool.pages_needed(id, n); true }
                2 => {
                    if n < 1 << 20 || !pool.can_reserve(id, n) {
                        pool.reserve(id, n).is_err()
                    } else {
                        true // would need gigabytes of slot array; can_reserve alone is enough
                    }
                }
                3 => pool.truncate(id, b).is_err(),
                4 => pool.truncate(id, pool.len(id).unwrap_or(0).saturating_sub(c)).is_err(),
                5 => pool.free_request(id).is_err(),
                6 => { let _ = pool.kv_indices(id, b.min(c), if c % 2 == 0 { c % 64 } else { c }); true }
                _ => { let _ = pool.len(id); let _ = pool.pages(id); true }
            };
            if failed {
                prop_assert_eq!(&pool, &before);
            }
            prop_assert_eq!(pool.num_free_pages() + pool.num_used_pages(), pool.num_pages());
        }
    }
}

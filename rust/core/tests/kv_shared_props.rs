//! Property tests of shared (prefix-cached) pages in the KV pool: random sequences of reserve,
//! truncate, free, caching a request's full page, registering a request over cached pages and
//! the cache letting go. After every step the holders are recounted from the page tables
//! (`check_holders`): a page is free exactly when no request and not the cache holds it. Every
//! failing call leaves the pool unchanged.

use proptest::prelude::*;
use specdial_core::kv::PagePool;

#[derive(Debug, Clone)]
enum Op {
    Add(u64),
    Reserve(u64, u64),
    TruncateBy(u64, u64),
    Free(u64),
    /// The cache takes page `index` of the request (often not full, or already cached: errors).
    Cache(u64, usize),
    /// Register the request over the first `n` cached pages, in the cache's order.
    AddWithPrefix(u64, usize),
    /// The cache lets go of its `i`-th page (an error while a request holds it).
    Uncache(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u64..5;
    prop_oneof![
        2 => id.clone().prop_map(Op::Add),
        4 => (id.clone(), 0u64..12).prop_map(|(i, n)| Op::Reserve(i, n)),
        2 => (id.clone(), 0u64..8).prop_map(|(i, k)| Op::TruncateBy(i, k)),
        1 => id.clone().prop_map(Op::Free),
        3 => (id.clone(), 0usize..5).prop_map(|(i, p)| Op::Cache(i, p)),
        2 => (id, 0usize..4).prop_map(|(i, n)| Op::AddWithPrefix(i, n)),
        2 => (0usize..8).prop_map(Op::Uncache),
    ]
}

fn run(num_pages: u32, page_size: u32, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut pool = PagePool::new(num_pages, page_size).unwrap();
    // the cache's pages in the order it took them
    let mut cached: Vec<u32> = Vec::new();
    for op in ops {
        let before = pool.clone();
        let ok = match *op {
            Op::Add(id) => pool.add_request(id).is_ok(),
            Op::Reserve(id, n) => pool.reserve(id, n).is_ok(),
            Op::TruncateBy(id, k) => match pool.len(id) {
                Ok(len) => pool.truncate(id, len.saturating_sub(k)).is_ok(),
                Err(_) => false,
            },
            Op::Free(id) => pool.free_request(id).is_ok(),
            Op::Cache(id, index) => match pool.cache_page(id, index) {
                Ok(page) => {
                    cached.push(page);
                    true
                }
                Err(_) => false,
            },
            Op::AddWithPrefix(id, n) => {
                let n = n.min(cached.len());
                pool.add_request_with_prefix(id, &cached[..n]).is_ok()
            }
            Op::Uncache(i) => match cached.get(i).copied() {
                Some(page) => {
                    let ok = pool.uncache_page(page).is_ok();
                    prop_assert_eq!(ok, before.holders(page) == Some(1));
                    if ok {
                        cached.remove(i);
                    }
                    ok
                }
                None => false,
            },
        };
        if !ok {
            prop_assert_eq!(&pool, &before, "a failed {:?} changed the pool", op);
        }
        if let Err(e) = pool.check_holders() {
            return Err(TestCaseError::fail(format!("after {op:?}: {e}")));
        }
        prop_assert_eq!(pool.num_cached_pages() as usize, cached.len());
        prop_assert_eq!(pool.num_free_pages() + pool.num_used_pages(), pool.num_pages());
        prop_assert_eq!(
            pool.num_held_pages() + pool.num_cache_only_pages(),
            pool.num_used_pages()
        );
    }
    // Everyone lets go: every page comes back.
    for id in 0..5 {
        let _ = pool.free_request(id);
    }
    prop_assert_eq!(pool.num_cache_only_pages() as usize, cached.len());
    for page in cached {
        pool.uncache_page(page).unwrap();
    }
    prop_assert_eq!(pool.num_free_pages(), pool.num_pages());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn shared_pages_are_freed_exactly_when_the_last_holder_lets_go(
        num_pages in 1u32..12,
        page_size in 1u32..4,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(num_pages, page_size, &ops)?;
    }
}

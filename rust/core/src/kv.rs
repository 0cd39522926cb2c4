//! KV page allocator shared by the target and drafter KV pools.
//!
//! The KV cache is a flat array of `num_pages * page_size` **KV slots**; one KV slot holds the
//! K/V entries of one token. KV slots are handed out in **pages** of `page_size` consecutive KV
//! slots: token position `t` of a request lives in KV index
//! `pages[t / page_size] * page_size + t % page_size`, where `pages` is the request's page table.
//!
//! Units used throughout: *tokens* (positions in a request's sequence), *pages* (page ids
//! `0..num_pages`) and *KV indices* (of KV slots, `0..num_pages * page_size`, into the KV
//! buffers, `i64` so they can go straight into a torch index tensor).
//!
//! Naming: a plain "slot" elsewhere in the core is the policy's batch-size range
//! ([`crate::slot`]); here it is always a "KV slot" / "KV index" (the Rust methods are
//! [`PagePool::kv_indices`] and [`PagePool::num_kv_slots`]). The Python-facing names keep
//! SGLang's and the worker's `num_slots` / `slots(...)` (bindings).
//!
//! Requests follow a check/act pattern (like nano-vllm's `can_allocate` / `allocate`):
//! [`PagePool::can_reserve`] says whether [`PagePool::reserve`] would succeed. Every method that
//! fails returns a [`KvError`] and leaves the pool exactly as it was; no input panics.
//!
//! Speculative decoding reserves `steps + 1` KV slots per request per iteration and then gives back
//! the rejected tail with [`PagePool::truncate`], which frees pages that become empty.

use crate::id_hash::IdMap;

use thiserror::Error;

mod shared;

type RequestMap = IdMap<PageTable>;

/// A rejected operation on a [`PagePool`]. The pool is unchanged when one is returned.
///
/// Surfaces in Python as `specdial.KvError` (a `ValueError`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KvError {
    /// `PagePool::new` was given `num_pages == 0`.
    #[error("num_pages must be >= 1, got 0")]
    ZeroPages,
    /// `PagePool::new` was given `page_size == 0`.
    #[error("page_size must be >= 1 (tokens per page), got 0")]
    ZeroPageSize,
    /// `num_pages * page_size` slots do not fit in an `i64` slot index.
    #[error(
        "num_pages * page_size = {num_pages} * {page_size} slots exceeds the largest i64 slot \
         index ({max})",
        max = i64::MAX
    )]
    TooManySlots { num_pages: u32, page_size: u32 },
    /// `add_request` with an id that already has a page table.
    #[error("request {0} is already registered")]
    DuplicateRequest(u64),
    /// The id has no page table: it was never added, or it was already freed.
    #[error("unknown request {0} (never added, or already freed)")]
    UnknownRequest(u64),
    /// `reserve` needs more pages than are free.
    #[error(
        "request {request_id}: reserving {n_tokens} tokens needs {needed} more pages, \
         only {free} of {total} pages are free"
    )]
    OutOfPages {
        request_id: u64,
        n_tokens: u64,
        needed: u64,
        free: u32,
        total: u32,
    },
    /// A token range that is not `start <= end <= len`.
    #[error(
        "request {request_id}: token range {start}..{end} is invalid for a request of length \
         {len} tokens (need start <= end <= length)"
    )]
    InvalidRange {
        request_id: u64,
        start: u64,
        end: u64,
        len: u64,
    },
    /// `truncate` to a length above the current one.
    #[error(
        "request {request_id}: cannot truncate to {new_len} tokens, its length is only {len} \
         tokens (truncate only shortens)"
    )]
    TruncateBeyondLength {
        request_id: u64,
        new_len: u64,
        len: u64,
    },
    /// `add_request_with_prefix` or `cache_page` named a page that is not in the right state:
    /// not cached (a prefix page), or not held by exactly this request alone (a page to cache).
    #[error("page {page}: {message}")]
    BadPage { page: u32, message: &'static str },
    /// The host could not allocate memory for the page table or the slot array.
    #[error("request {request_id}: out of host memory for {what} of {count} entries")]
    HostMemory {
        request_id: u64,
        what: &'static str,
        count: u64,
    },
}

/// One request's page table: its pages in token order, and its length in tokens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct PageTable {
    /// Page ids; page `i` holds token positions `i * page_size .. (i + 1) * page_size`.
    pages: Vec<u32>,
    /// Length in tokens. Always `pages.len() == ceil(len / page_size)`.
    len: u64,
}

/// Fixed-size pool of KV pages with per-request page tables.
///
/// Free pages are a stack: pages returned by `truncate` / `free_request` are pushed, and
/// allocation pops, so allocating or freeing one page is O(1). Pages never handed out yet are
/// not materialised: they are taken in increasing order from a watermark, so creating a pool is
/// O(1) whatever its size. A fresh pool therefore hands out pages `0, 1, 2, ...`, and a request
/// that truncates and re-reserves (with no allocation in between) gets the same pages back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagePool {
    num_pages: u32,
    page_size: u32,
    /// Freed pages, top of the stack last.
    free_stack: Vec<u32>,
    /// Pages `next_fresh..num_pages` have never been allocated and are free.
    next_fresh: u32,
    requests: RequestMap,
    /// Pages the prefix cache holds, with their holders: the cache plus every request whose
    /// page table has the page (so always >= 1). A page not in here is held by at most one
    /// request, or is free. See [`shared`].
    cached: IdMap<u32>,
    /// Cached pages no request holds (holders == 1): what eviction may take.
    cache_only: u32,
}

impl PagePool {
    /// A pool of `num_pages` pages of `page_size` tokens each, all free.
    ///
    /// Errors: [`KvError::ZeroPages`], [`KvError::ZeroPageSize`], or
    /// [`KvError::TooManySlots`] when `num_pages * page_size > i64::MAX`.
    pub fn new(num_pages: u32, page_size: u32) -> Result<Self, KvError> {
        if num_pages == 0 {
            return Err(KvError::ZeroPages);
        }
        if page_size == 0 {
            return Err(KvError::ZeroPageSize);
        }
        if u64::from(num_pages) * u64::from(page_size) > i64::MAX as u64 {
            return Err(KvError::TooManySlots {
                num_pages,
                page_size,
            });
        }
        Ok(Self {
            num_pages,
            page_size,
            free_stack: Vec::new(),
            next_fresh: 0,
            requests: RequestMap::default(),
            cached: IdMap::default(),
            cache_only: 0,
        })
    }

    /// Total pages in the pool.
    pub fn num_pages(&self) -> u32 {
        self.num_pages
    }

    /// Tokens (slots) per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Total slots, `num_pages * page_size`: the first dimension of the KV buffers.
    pub fn num_kv_slots(&self) -> u64 {
        u64::from(self.num_pages) * u64::from(self.page_size)
    }

    /// Pages neither a request nor the prefix cache holds.
    pub fn num_free_pages(&self) -> u32 {
        // free_stack only holds pages below next_fresh, each at most once: no overflow.
        self.free_stack.len() as u32 + (self.num_pages - self.next_fresh)
    }

    /// Pages held by some request or the prefix cache. Always `num_free_pages() +
    /// num_used_pages() == num_pages()`; without a cache, the pages requests own.
    pub fn num_used_pages(&self) -> u32 {
        self.num_pages - self.num_free_pages()
    }

    /// Registered requests (added and not yet freed).
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Whether `request_id` is registered.
    pub fn has_request(&self, request_id: u64) -> bool {
        self.requests.contains_key(&request_id)
    }

    /// Registers `request_id` with an empty page table (length 0 tokens, no pages).
    ///
    /// Errors: [`KvError::DuplicateRequest`] if it is already registered.
    pub fn add_request(&mut self, request_id: u64) -> Result<(), KvError> {
        use std::collections::hash_map::Entry;
        match self.requests.entry(request_id) {
            Entry::Occupied(_) => Err(KvError::DuplicateRequest(request_id)),
            Entry::Vacant(v) => {
                v.insert(PageTable::default());
                Ok(())
            }
        }
    }

    /// Length of `request_id` in tokens.
    ///
    /// Errors: [`KvError::UnknownRequest`].
    pub fn len(&self, request_id: u64) -> Result<u64, KvError> {
        Ok(self.table(request_id)?.len)
    }

    /// The page table of `request_id`: its page ids in token order.
    ///
    /// Errors: [`KvError::UnknownRequest`].
    pub fn pages(&self, request_id: u64) -> Result<&[u32], KvError> {
        Ok(&self.table(request_id)?.pages)
    }

    /// Pages that extending `request_id` by `n_tokens` tokens would allocate
    /// (0 while the new tokens fit in its last page). Saturates at `u64::MAX`.
    ///
    /// Errors: [`KvError::UnknownRequest`].
    pub fn pages_needed(&self, request_id: u64, n_tokens: u64) -> Result<u64, KvError> {
        let table = self.table(request_id)?;
        Ok(self.pages_needed_for(table, n_tokens))
    }

    /// Whether [`reserve`](Self::reserve)`(request_id, n_tokens)` would succeed: the request is
    /// registered and enough pages are free.
    pub fn can_reserve(&self, request_id: u64, n_tokens: u64) -> bool {
        match self.requests.get(&request_id) {
            Some(table) => {
                self.pages_needed_for(table, n_tokens) <= u64::from(self.num_free_pages())
            }
            None => false,
        }
    }

    /// Extends `request_id` by `n_tokens` tokens, allocating pages as needed, and returns the
    /// slot indices of the new token positions `len .. len + n_tokens`.
    ///
    /// Errors (pool unchanged): [`KvError::UnknownRequest`], [`KvError::OutOfPages`],
    /// [`KvError::HostMemory`].
    pub fn reserve(&mut self, request_id: u64, n_tokens: u64) -> Result<Vec<i64>, KvError> {
        let mut out = Vec::new();
        self.reserve_into(request_id, n_tokens, &mut out)?;
        Ok(out)
    }

    /// [`reserve`](Self::reserve), appending the slot indices to `out` (which is left as it was
    /// on error). Lets a scheduler fill one batch-wide slot array without allocating.
    pub fn reserve_into(
        &mut self,
        request_id: u64,
        n_tokens: u64,
        out: &mut Vec<i64>,
    ) -> Result<(), KvError> {
        let free = self.num_free_pages();
        let total = self.num_pages;
        let page_size = u64::from(self.page_size);
        let Some(table) = self.requests.get_mut(&request_id) else {
            return Err(KvError::UnknownRequest(request_id));
        };
        let needed = pages_needed(table, page_size, n_tokens);
        if needed > u64::from(free) {
            return Err(KvError::OutOfPages {
                request_id,
                n_tokens,
                needed,
                free,
                total,
            });
        }
        // needed <= free <= u32::MAX, and the new length fits: len + n_tokens <= num_kv_slots.
        let start = table.len;
        let end = start + n_tokens;
        let host_memory = |what, count| KvError::HostMemory {
            request_id,
            what,
            count,
        };
        let count = usize::try_from(n_tokens).map_err(|_| host_memory("slot array", n_tokens))?;
        out.try_reserve(count)
            .map_err(|_| host_memory("slot array", n_tokens))?;
        table
            .pages
            .try_reserve(needed as usize)
            .map_err(|_| host_memory("page table", needed))?;

        // Nothing can fail from here on.
        for _ in 0..needed {
            let page = match self.free_stack.pop() {
                Some(p) => p,
                None => {
                    let p = self.next_fresh;
                    self.next_fresh += 1;
                    p
                }
            };
            table.pages.push(page);
        }
        table.len = end;
        push_kv_indices(&table.pages, page_size, start, end, out);
        Ok(())
    }

    /// Slot indices of token positions `start .. end` of `request_id`.
    ///
    /// Errors: [`KvError::UnknownRequest`], [`KvError::InvalidRange`] unless
    /// `start <= end <= len`, [`KvError::HostMemory`].
    pub fn kv_indices(&self, request_id: u64, start: u64, end: u64) -> Result<Vec<i64>, KvError> {
        let mut out = Vec::new();
        self.kv_indices_into(request_id, start, end, &mut out)?;
        Ok(out)
    }

    /// [`kv_indices`](Self::kv_indices), appending to `out` (left as it was on error).
    pub fn kv_indices_into(
        &self,
        request_id: u64,
        start: u64,
        end: u64,
        out: &mut Vec<i64>,
    ) -> Result<(), KvError> {
        let table = self.table(request_id)?;
        if start > end || end > table.len {
            return Err(KvError::InvalidRange {
                request_id,
                start,
                end,
                len: table.len,
            });
        }
        // end <= len <= num_kv_slots fits in memory already reserved for the page table's tokens.
        out.try_reserve((end - start) as usize)
            .map_err(|_| KvError::HostMemory {
                request_id,
                what: "slot array",
                count: end - start,
            })?;
        push_kv_indices(&table.pages, u64::from(self.page_size), start, end, out);
        Ok(())
    }

    /// Shortens `request_id` to `new_len` tokens (e.g. dropping rejected draft tokens) and
    /// returns the number of pages it let go of: those holding no token below `new_len` (a page
    /// the prefix cache also holds stays with the cache).
    /// `new_len == len` is a no-op.
    ///
    /// Errors (pool unchanged): [`KvError::UnknownRequest`], [`KvError::TruncateBeyondLength`].
    pub fn truncate(&mut self, request_id: u64, new_len: u64) -> Result<u32, KvError> {
        let page_size = u64::from(self.page_size);
        let Some(table) = self.requests.get_mut(&request_id) else {
            return Err(KvError::UnknownRequest(request_id));
        };
        if new_len > table.len {
            return Err(KvError::TruncateBeyondLength {
                request_id,
                new_len,
                len: table.len,
            });
        }
        let keep = new_len.div_ceil(page_size) as usize;
        let freed = table.pages.len() - keep;
        // Pop from the tail so that the first dropped page ends on top of the free stack:
        // re-reserving the same request gets the same pages back in the same order.
        while table.pages.len() > keep {
            let page = table.pages.pop().expect("len > keep");
            release(&mut self.cached, &mut self.cache_only, &mut self.free_stack, page);
        }
        table.len = new_len;
        Ok(freed as u32)
    }

    /// Unregisters `request_id` and lets go of all its pages; returns how many. A page goes back
    /// to the free pages unless the prefix cache holds it too.
    ///
    /// Errors: [`KvError::UnknownRequest`] (never added, or freed twice).
    pub fn free_request(&mut self, request_id: u64) -> Result<u32, KvError> {
        let Some(mut table) = self.requests.remove(&request_id) else {
            return Err(KvError::UnknownRequest(request_id));
        };
        let freed = table.pages.len() as u32;
        while let Some(page) = table.pages.pop() {
            release(&mut self.cached, &mut self.cache_only, &mut self.free_stack, page);
        }
        Ok(freed)
    }

    fn table(&self, request_id: u64) -> Result<&PageTable, KvError> {
        self.requests
            .get(&request_id)
            .ok_or(KvError::UnknownRequest(request_id))
    }

    fn pages_needed_for(&self, table: &PageTable, n_tokens: u64) -> u64 {
        pages_needed(table, u64::from(self.page_size), n_tokens)
    }
}

/// A request lets go of `page`: a cached page loses one holder (the cache keeps it), any other
/// page is free again.
fn release(cached: &mut IdMap<u32>, cache_only: &mut u32, free_stack: &mut Vec<u32>, page: u32) {
    match cached.get_mut(&u64::from(page)) {
        Some(holders) => {
            *holders -= 1;
            if *holders == 1 {
                *cache_only += 1;
            }
        }
        None => free_stack.push(page),
    }
}

/// Pages to allocate to grow `table` by `n_tokens` tokens, saturating at `u64::MAX`.
fn pages_needed(table: &PageTable, page_size: u64, n_tokens: u64) -> u64 {
    let new_len = u128::from(table.len) + u128::from(n_tokens);
    let pages = new_len.div_ceil(u128::from(page_size));
    let needed = pages - table.pages.len() as u128;
    u64::try_from(needed).unwrap_or(u64::MAX)
}

/// Appends the slots of token positions `start..end` (all `< pages.len() * page_size`).
fn push_kv_indices(pages: &[u32], page_size: u64, start: u64, end: u64, out: &mut Vec<i64>) {
    let mut pos = start;
    while pos < end {
        let page_index = pos / page_size;
        let offset = pos % page_size;
        let run = (page_size - offset).min(end - pos);
        let base = (u64::from(pages[page_index as usize]) * page_size + offset) as i64;
        out.extend(base..base + run as i64);
        pos += run;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(num_pages: u32, page_size: u32) -> PagePool {
        PagePool::new(num_pages, page_size).unwrap()
    }

    #[test]
    fn new_rejects_zero_and_oversized() {
        assert_eq!(PagePool::new(0, 16), Err(KvError::ZeroPages));
        assert_eq!(PagePool::new(8, 0), Err(KvError::ZeroPageSize));
        let err = PagePool::new(u32::MAX, u32::MAX).unwrap_err();
        assert_eq!(
            err,
            KvError::TooManySlots {
                num_pages: u32::MAX,
                page_size: u32::MAX
            }
        );
        assert!(err
            .to_string()
            .contains("exceeds the largest i64 slot index"));
        // The largest pools are O(1) to create: nothing is allocated up front.
        let big = pool(u32::MAX, 1 << 31);
        assert_eq!(big.num_free_pages(), u32::MAX);
        assert_eq!(big.num_kv_slots(), u64::from(u32::MAX) << 31);
    }

    #[test]
    fn error_messages_name_the_problem() {
        assert_eq!(
            KvError::ZeroPages.to_string(),
            "num_pages must be >= 1, got 0"
        );
        assert!(KvError::ZeroPageSize
            .to_string()
            .starts_with("page_size must be >= 1"));
        assert_eq!(
            KvError::DuplicateRequest(7).to_string(),
            "request 7 is already registered"
        );
        assert!(KvError::UnknownRequest(7)
            .to_string()
            .starts_with("unknown request 7"));
    }

    #[test]
    fn fresh_pool_hands_out_pages_in_order() {
        let mut p = pool(4, 4);
        p.add_request(1).unwrap();
        assert_eq!(p.reserve(1, 6).unwrap(), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(p.pages(1).unwrap(), &[0, 1]);
        assert_eq!(p.reserve(1, 3).unwrap(), vec![6, 7, 8]);
        assert_eq!(p.pages(1).unwrap(), &[0, 1, 2]);
        assert_eq!(p.len(1), Ok(9));
        assert_eq!(p.kv_indices(1, 0, 9).unwrap(), (0..9).collect::<Vec<i64>>());
        assert_eq!(p.kv_indices(1, 5, 5).unwrap(), Vec::<i64>::new());
        assert_eq!(p.num_used_pages(), 3);
        assert_eq!(p.num_free_pages(), 1);
    }

    #[test]
    fn slots_follow_the_page_table() {
        let mut p = pool(4, 2);
        p.add_request(1).unwrap();
        p.add_request(2).unwrap();
        assert_eq!(p.reserve(1, 2).unwrap(), vec![0, 1]); // page 0
        assert_eq!(p.reserve(2, 2).unwrap(), vec![2, 3]); // page 1
        assert_eq!(p.reserve(1, 1).unwrap(), vec![4]); // page 2
        assert_eq!(p.free_request(2), Ok(1));
        assert_eq!(p.reserve(1, 3).unwrap(), vec![5, 2, 3]); // rest of page 2, then page 1
        assert_eq!(p.pages(1).unwrap(), &[0, 2, 1]);
        assert_eq!(p.kv_indices(1, 1, 6).unwrap(), vec![1, 4, 5, 2, 3]);
    }

    #[test]
    fn add_request_twice_is_an_error() {
        let mut p = pool(2, 2);
        p.add_request(5).unwrap();
        p.reserve(5, 3).unwrap();
        let before = p.clone();
        assert_eq!(p.add_request(5), Err(KvError::DuplicateRequest(5)));
        assert_eq!(p, before);
        assert_eq!(p.len(5), Ok(3));
    }

    #[test]
    fn unknown_request_errors_everywhere() {
        let mut p = pool(2, 2);
        let unknown = Err(KvError::UnknownRequest(9));
        assert_eq!(p.len(9), unknown);
        assert_eq!(p.pages(9), Err(KvError::UnknownRequest(9)));
        assert_eq!(p.pages_needed(9, 1), unknown);
        assert!(!p.can_reserve(9, 0));
        assert_eq!(p.reserve(9, 1), Err(KvError::UnknownRequest(9)));
        assert_eq!(p.kv_indices(9, 0, 0), Err(KvError::UnknownRequest(9)));
        assert_eq!(p.truncate(9, 0), Err(KvError::UnknownRequest(9)));
        assert_eq!(p.free_request(9), Err(KvError::UnknownRequest(9)));
        assert_eq!(p, pool(2, 2));
    }

    #[test]
    fn free_twice_is_an_error() {
        let mut p = pool(2, 2);
        p.add_request(1).unwrap();
        p.reserve(1, 3).unwrap();
        assert_eq!(p.free_request(1), Ok(2));
        assert_eq!(p.free_request(1), Err(KvError::UnknownRequest(1)));
        assert_eq!(p.num_free_pages(), 2);
        assert_eq!(p.num_requests(), 0);
    }

    #[test]
    fn reserve_beyond_free_pages_changes_nothing() {
        let mut p = pool(3, 4);
        p.add_request(1).unwrap();
        p.add_request(2).unwrap();
        p.reserve(1, 5).unwrap(); // 2 pages, 3 free slots in page 1
        p.reserve(2, 1).unwrap(); // 1 page
        assert!(p.can_reserve(1, 3));
        assert!(!p.can_reserve(1, 4));
        assert_eq!(p.pages_needed(1, 3), Ok(0));
        assert_eq!(p.pages_needed(1, 4), Ok(1));
        let before = p.clone();
        let mut out = vec![-1];
        let err = p.reserve_into(1, 4, &mut out).unwrap_err();
        assert_eq!(
            err,
            KvError::OutOfPages {
                request_id: 1,
                n_tokens: 4,
                needed: 1,
                free: 0,
                total: 3
            }
        );
        assert_eq!(
            err.to_string(),
            "request 1: reserving 4 tokens needs 1 more pages, only 0 of 3 pages are free"
        );
        assert_eq!(out, vec![-1]);
        assert_eq!(p, before);
        // Huge requests are refused the same way, without overflow.
        assert_eq!(p.pages_needed(1, u64::MAX), Ok((1 << 62) - 1));
        assert!(!p.can_reserve(1, u64::MAX));
        assert!(matches!(
            p.reserve(1, u64::MAX),
            Err(KvError::OutOfPages { .. })
        ));
        assert_eq!(p, before);
        assert_eq!(p.reserve(1, 3).unwrap(), vec![5, 6, 7]);
    }

    #[test]
    fn pages_needed_saturates() {
        let mut p = pool(1, 1);
        p.add_request(1).unwrap();
        p.reserve(1, 1).unwrap();
        assert_eq!(p.pages_needed(1, u64::MAX), Ok(u64::MAX));
        assert_eq!(p.pages_needed(1, 0), Ok(0));
    }

    #[test]
    fn reserve_zero_tokens_is_a_no_op() {
        let mut p = pool(1, 1);
        p.add_request(1).unwrap();
        assert!(p.can_reserve(1, 0));
        assert_eq!(p.reserve(1, 0).unwrap(), Vec::<i64>::new());
        assert_eq!(p.num_used_pages(), 0);
    }

    #[test]
    fn invalid_slot_ranges_are_errors() {
        let mut p = pool(2, 4);
        p.add_request(3).unwrap();
        p.reserve(3, 5).unwrap();
        let err = p.kv_indices(3, 4, 6).unwrap_err();
        assert_eq!(
            err,
            KvError::InvalidRange {
                request_id: 3,
                start: 4,
                end: 6,
                len: 5
            }
        );
        assert_eq!(
            err.to_string(),
            "request 3: token range 4..6 is invalid for a request of length 5 tokens \
             (need start <= end <= length)"
        );
        assert!(matches!(
            p.kv_indices(3, 3, 2),
            Err(KvError::InvalidRange { .. })
        ));
        assert!(matches!(
            p.kv_indices(3, u64::MAX, u64::MAX),
            Err(KvError::InvalidRange { .. })
        ));
        let mut out = vec![7];
        assert!(p.kv_indices_into(3, 0, 9, &mut out).is_err());
        assert_eq!(out, vec![7]);
        p.kv_indices_into(3, 3, 5, &mut out).unwrap();
        assert_eq!(out, vec![7, 3, 4]);
    }

    #[test]
    fn truncate_beyond_length_is_an_error() {
        let mut p = pool(2, 4);
        p.add_request(1).unwrap();
        p.reserve(1, 3).unwrap();
        let before = p.clone();
        let err = p.truncate(1, 4).unwrap_err();
        assert_eq!(
            err,
            KvError::TruncateBeyondLength {
                request_id: 1,
                new_len: 4,
                len: 3
            }
        );
        assert_eq!(
            err.to_string(),
            "request 1: cannot truncate to 4 tokens, its length is only 3 tokens \
             (truncate only shortens)"
        );
        assert_eq!(p, before);
        assert_eq!(p.truncate(1, 3), Ok(0));
        assert_eq!(p, before);
    }

    #[test]
    fn truncate_frees_pages_at_page_boundaries() {
        let mut p = pool(4, 4);
        p.add_request(1).unwrap();
        p.reserve(1, 12).unwrap(); // pages 0, 1, 2, all full
        assert_eq!(p.num_free_pages(), 1);
        // Inside the last page: nothing freed.
        assert_eq!(p.truncate(1, 9), Ok(0));
        assert_eq!(p.pages(1).unwrap(), &[0, 1, 2]);
        // Exactly at a boundary: the last page held only tokens 8.. and is freed.
        assert_eq!(p.truncate(1, 8), Ok(1));
        assert_eq!(p.pages(1).unwrap(), &[0, 1]);
        assert_eq!(p.num_free_pages(), 2);
        // One token past a boundary keeps that page.
        assert_eq!(p.truncate(1, 5), Ok(0));
        assert_eq!(p.pages(1).unwrap(), &[0, 1]);
        // Across two boundaries.
        p.reserve(1, 7).unwrap(); // len 12 again: pages 0, 1, 2
        assert_eq!(p.truncate(1, 1), Ok(2));
        assert_eq!(p.pages(1).unwrap(), &[0]);
        // To zero: every page goes, the request stays registered.
        assert_eq!(p.truncate(1, 0), Ok(1));
        assert_eq!(p.pages(1).unwrap(), &[] as &[u32]);
        assert_eq!(p.len(1), Ok(0));
        assert_eq!(p.num_free_pages(), 4);
        assert!(p.has_request(1));
    }

    #[test]
    fn truncate_then_reserve_reuses_the_same_slots() {
        let mut p = pool(8, 2);
        p.add_request(1).unwrap();
        let first = p.reserve(1, 9).unwrap();
        p.truncate(1, 2).unwrap();
        let again = p.reserve(1, 7).unwrap();
        assert_eq!(again, first[2..]);
    }

    #[test]
    fn freeing_everything_returns_every_page() {
        let mut p = pool(5, 3);
        for id in 0..5 {
            p.add_request(id).unwrap();
            p.reserve(id, 3).unwrap();
        }
        assert_eq!(p.num_free_pages(), 0);
        assert!(!p.can_reserve(0, 1));
        for id in 0..5 {
            assert_eq!(p.free_request(id), Ok(1));
        }
        assert_eq!(p.num_free_pages(), 5);
        assert_eq!(p.num_used_pages(), 0);
        assert_eq!(p.num_requests(), 0);
    }
}

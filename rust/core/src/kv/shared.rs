//! Pages shared through the prefix cache: holders counted per cached page.
//!
//! A page the prefix cache holds ([`PagePool::cache_page`]) counts its *holders*: the cache plus
//! every request whose page table has it. Requests take cached pages at registration
//! ([`PagePool::add_request_with_prefix`]) and let go of them through `truncate` /
//! `free_request` like their own pages; the page is freed exactly when its last holder lets go,
//! which is the cache's [`PagePool::uncache_page`] (eviction or a flush), refused while a
//! request still holds it. Every failing call leaves the pool unchanged.

use std::collections::HashMap;

use super::{KvError, PagePool, PageTable};

impl PagePool {
    /// Registers `request_id` with `pages` (cached pages, in token order) as the first
    /// `pages.len()` full pages of its page table: its length is `pages.len() * page_size`
    /// tokens, and each page gains it as a holder.
    ///
    /// Errors (pool unchanged): [`KvError::DuplicateRequest`]; [`KvError::BadPage`] for a page
    /// the cache does not hold or named twice; [`KvError::HostMemory`].
    pub fn add_request_with_prefix(&mut self, request_id: u64, pages: &[u32]) -> Result<(), KvError> {
        if self.requests.contains_key(&request_id) {
            return Err(KvError::DuplicateRequest(request_id));
        }
        let mut seen = HashMap::with_capacity(pages.len());
        for &page in pages {
            if !self.cached.contains_key(&u64::from(page)) {
                return Err(KvError::BadPage { page, message: "is not held by the prefix cache" });
            }
            if seen.insert(page, ()).is_some() {
                return Err(KvError::BadPage { page, message: "is named twice in one prefix" });
            }
        }
        let mut table = PageTable::default();
        table.pages.try_reserve(pages.len()).map_err(|_| KvError::HostMemory {
            request_id,
            what: "page table",
            count: pages.len() as u64,
        })?;
        self.requests.try_reserve(1).map_err(|_| KvError::HostMemory {
            request_id,
            what: "request map",
            count: 1,
        })?;
        // Nothing can fail from here on.
        for &page in pages {
            let holders = self.cached.get_mut(&u64::from(page)).expect("checked above");
            if *holders == 1 {
                self.cache_only -= 1;
            }
            *holders += 1;
        }
        table.pages.extend_from_slice(pages);
        table.len = pages.len() as u64 * u64::from(self.page_size);
        self.requests.insert(request_id, table);
        Ok(())
    }

    /// The prefix cache takes page `index` of `request_id`'s page table as a second holder; the
    /// page must be full (all its tokens below the request's length) and not cached yet.
    /// Returns the page id.
    ///
    /// Errors (pool unchanged): [`KvError::UnknownRequest`], [`KvError::InvalidRange`] when the
    /// page is not full, [`KvError::BadPage`] when it is cached already.
    pub fn cache_page(&mut self, request_id: u64, index: usize) -> Result<u32, KvError> {
        let table = self.table(request_id)?;
        let ps = u64::from(self.page_size);
        let end = (index as u64 + 1).saturating_mul(ps);
        if index >= table.pages.len() || end > table.len {
            return Err(KvError::InvalidRange {
                request_id,
                start: index as u64 * ps,
                end,
                len: table.len,
            });
        }
        let page = table.pages[index];
        if self.cached.contains_key(&u64::from(page)) {
            return Err(KvError::BadPage { page, message: "is cached already" });
        }
        self.cached.insert(u64::from(page), 2);
        Ok(page)
    }

    /// The prefix cache lets go of `page`, which no request may hold: the page is free again.
    ///
    /// Errors (pool unchanged): [`KvError::BadPage`] when the cache does not hold it or a
    /// request still does.
    pub fn uncache_page(&mut self, page: u32) -> Result<(), KvError> {
        match self.cached.get(&u64::from(page)) {
            None => Err(KvError::BadPage { page, message: "is not held by the prefix cache" }),
            Some(&h) if h > 1 => Err(KvError::BadPage { page, message: "is still held by a request" }),
            Some(_) => {
                self.cached.remove(&u64::from(page));
                self.cache_only -= 1;
                self.free_stack.push(page);
                Ok(())
            }
        }
    }

    /// Holders of a cached page (the cache plus the requests that hold it), `None` when the
    /// cache does not hold it.
    pub fn holders(&self, page: u32) -> Option<u32> {
        self.cached.get(&u64::from(page)).copied()
    }

    /// Pages the prefix cache holds (shared with requests or not).
    pub fn num_cached_pages(&self) -> u32 {
        self.cached.len() as u32
    }

    /// Cached pages no request holds: what eviction can free.
    pub fn num_cache_only_pages(&self) -> u32 {
        self.cache_only
    }

    /// Pages held by at least one request (a shared page once).
    pub fn num_held_pages(&self) -> u32 {
        self.num_used_pages() - self.cache_only
    }

    /// Recounts every page's holders from the page tables and checks them against the pool's
    /// books: a cached page has `1 +` its requests as holders, any other used page exactly one
    /// request, a free page none, and the counts add up (for tests; O(pages held)).
    pub fn check_holders(&self) -> Result<(), String> {
        let mut count: HashMap<u32, u32> = HashMap::new();
        for t in self.requests.values() {
            for &p in &t.pages {
                *count.entry(p).or_default() += 1;
            }
        }
        let mut cache_only = 0;
        for (&page, &holders) in &self.cached {
            let page = page as u32;
            let users = count.get(&page).copied().unwrap_or(0);
            if holders != users + 1 {
                return Err(format!("cached page {page}: {holders} holders, {users} requests + the cache"));
            }
            cache_only += u32::from(users == 0);
        }
        if cache_only != self.cache_only {
            return Err(format!("cache_only is {}, counted {cache_only}", self.cache_only));
        }
        for (&page, &users) in &count {
            if users > 1 && !self.cached.contains_key(&u64::from(page)) {
                return Err(format!("page {page} is in {users} page tables but not cached"));
            }
        }
        for &page in &self.free_stack {
            if count.contains_key(&page) || self.cached.contains_key(&u64::from(page)) {
                return Err(format!("free page {page} is held"));
            }
        }
        let held = count.len() as u32 + cache_only;
        if held != self.num_used_pages() {
            return Err(format!("{held} pages held, the pool counts {} used", self.num_used_pages()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Request 1 fills two pages of 2 tokens; the cache takes both.
    fn cached_pool() -> PagePool {
        let mut p = PagePool::new(4, 2).unwrap();
        p.add_request(1).unwrap();
        p.reserve(1, 5).unwrap();
        assert_eq!(p.cache_page(1, 0), Ok(0));
        assert_eq!(p.cache_page(1, 1), Ok(1));
        p
    }

    #[test]
    fn a_page_is_freed_when_its_last_holder_lets_go() {
        let mut p = cached_pool();
        assert_eq!(p.holders(0), Some(2));
        p.add_request_with_prefix(2, &[0, 1]).unwrap();
        assert_eq!(p.len(2), Ok(4));
        assert_eq!(p.holders(1), Some(3));
        p.check_holders().unwrap();
        assert_eq!(p.free_request(1), Ok(3)); // page 2 free, pages 0 and 1 stay
        assert_eq!(p.num_free_pages(), 2);
        assert_eq!(p.num_cache_only_pages(), 0);
        assert_eq!(p.uncache_page(0), Err(KvError::BadPage { page: 0, message: "is still held by a request" }));
        p.truncate(2, 2).unwrap(); // lets go of page 1: only the cache holds it now
        assert_eq!(p.num_cache_only_pages(), 1);
        assert_eq!(p.num_held_pages(), 1);
        p.check_holders().unwrap();
        p.uncache_page(1).unwrap();
        assert_eq!(p.num_free_pages(), 3);
        p.free_request(2).unwrap();
        assert_eq!(p.num_cache_only_pages(), 1);
        p.uncache_page(0).unwrap();
        assert_eq!(p.num_free_pages(), 4);
        p.check_holders().unwrap();
    }

    #[test]
    fn failing_calls_leave_the_pool_unchanged() {
        let mut p = cached_pool();
        let before = p.clone();
        assert!(matches!(p.add_request_with_prefix(1, &[0]), Err(KvError::DuplicateRequest(1))));
        assert!(matches!(p.add_request_with_prefix(3, &[0, 2]), Err(KvError::BadPage { page: 2, .. })));
        assert!(matches!(p.add_request_with_prefix(3, &[0, 0]), Err(KvError::BadPage { page: 0, .. })));
        assert!(matches!(p.cache_page(1, 2), Err(KvError::InvalidRange { .. }))); // not full
        assert!(matches!(p.cache_page(1, 0), Err(KvError::BadPage { .. })));
        assert!(matches!(p.cache_page(9, 0), Err(KvError::UnknownRequest(9))));
        assert!(matches!(p.uncache_page(2), Err(KvError::BadPage { .. })));
        assert_eq!(p, before);
    }
}

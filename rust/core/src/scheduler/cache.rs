//! The scheduler's side of the prefix cache ([`crate::prefix_cache`]): lookups at admission,
//! caching a request's full pages after each report, eviction before preemption,
//! `flush_cache`, and its gauges.
//!
//! Rules (each one is a test in `tests.rs` or the proptests):
//!
//! - **What is cached.** After every report (the one that finishes a request included), a
//!   request's full pages below its committed KV join the tree, in order: committed means the
//!   accepted tokens' KV (verify slots beyond the accepted length are truncated first and never
//!   cached; the last emitted token has no KV yet). The target's KV is what is cached, whatever
//!   the drafter's lag: a request that decoded at steps 0 with the draft extend skipped (or
//!   whose drafter prefill was deferred) caches its pages all the same.
//! - **The drafter's KV.** The drafter's KV and the EAGLE features live in the same KV slots as
//!   the target's. The features are written by the target's forwards, so every cached page has
//!   them; the drafter's KV only once a drafter ran over the page's positions. Each tree node
//!   records it: pages below `committed - draft_lag` are marked when cached, and a request
//!   whose drafter catches up over pages it cached (or took) unmarked marks them then. A
//!   request that hits counts only the marked leading pages as drafter-covered
//!   (`Plan::cached_draft_lens`); its drafter runs over the rest of the hit like over a
//!   deferred prefill (its `draft_lag`), writing the drafter's KV into those shared slots (the
//!   values any drafter computes from those tokens), so it never re-runs a marked position.
//!   If the tree already has another page for the same tokens (two requests computed it at
//!   once), the request stops caching.
//! - **Admission.** A request takes the longest cached prefix of its prefill range, whole
//!   pages, leaving at least one token to prefill (the first token is sampled from it) and no
//!   more than its `max_cached_tokens` (prompt log-probabilities need their positions computed;
//!   SGLang caps its match at `logprob_start_len` the same way). Only the uncached suffix counts
//!   against the prefill budget and the pages. A request is not admitted into the prefill plan
//!   that computes a page it would share with an earlier request of the same plan: it waits one
//!   iteration and then hits (so one context with several continuations is prefilled once).
//! - **Order.** Waiting requests never admitted are ordered longest cached prefix first before
//!   each prefill plan (SGLang's `lpm`), while at most [`LPM_MAX_WAITING`] wait; preempted ones
//!   stay first; otherwise admission is first come, first served.
//! - **Eviction.** Pages only the cache holds count as free for admission and decode, and are
//!   evicted least recently used leaf first when the pages are needed, so a request is preempted
//!   only when eviction cannot cover what a decode needs.

use super::request::Request;
use super::Scheduler;
use crate::prefix_cache::ROOT;

/// Most new waiting requests for which admission orders by cached prefix (SGLang's
/// `IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`-style cut-off: 128 there too).
pub const LPM_MAX_WAITING: usize = 128;

impl Scheduler {
    /// Drops every cached page no request holds (SGLang's `/flush_cache`). Refused, returning
    /// `false` with nothing changed, while any request is live (waiting, prefilling or running)
    /// or a plan is in flight, as SGLang refuses it while requests are running or queued.
    pub fn flush_cache(&mut self) -> bool {
        if self.has_unfinished() || self.in_flight.is_some() {
            return false;
        }
        for page in self.cache.clear() {
            self.pool.uncache_page(page).expect("no request holds a page while none is live");
        }
        true
    }

    /// Pages the prefix cache holds now, shared with requests or not.
    pub fn cached_pages(&self) -> u32 {
        self.pool.num_cached_pages()
    }

    /// Pages free now plus those eviction can free (only the cache holds them).
    pub(super) fn available_pages(&self) -> u64 {
        u64::from(self.pool.num_free_pages()) + u64::from(self.pool.num_cache_only_pages())
    }

    /// Evicts least recently used cache-only pages until `pages` pages are free (the caller
    /// counted them within [`available_pages`](Self::available_pages)).
    pub(super) fn make_free(&mut self, pages: u64) {
        let free = u64::from(self.pool.num_free_pages());
        if pages <= free {
            return;
        }
        let pool = &self.pool;
        let evicted = self.cache.evict((pages - free) as usize, |p| pool.holders(p) == Some(1));
        self.counters.evicted_pages += evicted.len() as u64;
        for page in evicted {
            self.pool.uncache_page(page).expect("an evictable page is held by the cache only");
        }
    }

    /// The cached pages' nodes an admission of waiting request `id` takes (empty with the
    /// cache off): the longest cached prefix of whole pages within its prefill range minus
    /// one token and its `max_cached_tokens`.
    pub(super) fn lookup(&mut self, id: u64) -> Vec<usize> {
        if !self.config.enable_prefix_caching {
            return Vec::new();
        }
        let r = &self.requests[&id];
        let limit = (r.prefill_target() - 1).min(r.max_cached);
        let max_pages = (limit / u64::from(self.config.page_size)) as usize;
        self.cache.match_prefix(&r.tokens, max_pages)
    }

    /// SGLang's longest-prefix-first (`--schedule-policy lpm`): orders the new waiting
    /// requests (never admitted; preempted ones keep their places in front) by the cached
    /// pages they would take, most first, ties in arrival order. Like SGLang, only while at
    /// most [`LPM_MAX_WAITING`] wait (beyond that the lookups cost more than they save and the
    /// queue stays first come, first served). A request that never matches can wait behind
    /// ones that keep matching, as in SGLang.
    pub(super) fn order_by_cached_prefix(&mut self) {
        let n = self.waiting.len() - self.waiting_preempted;
        if !self.config.enable_prefix_caching || !(2..=LPM_MAX_WAITING).contains(&n) || self.cache.is_empty() {
            return;
        }
        let ps = u64::from(self.config.page_size);
        let slots: Vec<usize> =
            (0..self.waiting.len()).filter(|&i| !self.requests[&self.waiting[i]].admitted_before).collect();
        let mut keyed: Vec<(usize, u64)> = slots
            .iter()
            .map(|&i| {
                let r = &self.requests[&self.waiting[i]];
                let limit = (r.prefill_target() - 1).min(r.max_cached);
                (self.cache.match_len(&r.tokens, (limit / ps) as usize), self.waiting[i])
            })
            .collect();
        keyed.sort_by_key(|&(pages, _)| std::cmp::Reverse(pages)); // stable: ties keep order
        for (&slot, &(_, id)) in slots.iter().zip(&keyed) {
            self.waiting[slot] = id;
        }
    }

    /// Whether `tokens[..end]` shares a whole page beyond its first `cached` tokens with a
    /// chunk `(id, start, end, ..)` already in the prefill plan being built (that page is not
    /// cached before the plan's report).
    pub(super) fn overlaps_plan(&self, tokens: &[i64], cached: u64, chunks: &[(u64, u64, u64, bool, bool, bool)]) -> bool {
        if !self.config.enable_prefix_caching {
            return false;
        }
        let need = cached + u64::from(self.config.page_size);
        chunks.iter().any(|c| {
            let other = &self.requests[&c.0].tokens[..c.2 as usize];
            let common = tokens.iter().zip(other).take_while(|(a, b)| a == b).count() as u64;
            common >= need
        })
    }

    /// Caches request `id`'s full pages below `committed` (see the module rules), after a
    /// report, and marks those below `committed - draft_lag` as carrying the drafter's KV.
    /// `committed`: its KV positions holding accepted tokens.
    pub(super) fn cache_committed(&mut self, id: u64, committed: u64) {
        if !self.config.enable_prefix_caching {
            return;
        }
        let ps = self.config.page_size as usize;
        let Some(r) = self.requests.get_mut(&id) else { return };
        let drafted = committed.saturating_sub(r.draft_lag) as usize / ps;
        while !r.cache_stopped && r.cache_pages < committed as usize / ps {
            let p = r.cache_pages;
            let key = &r.tokens[p * ps..(p + 1) * ps];
            if self.cache.child(r.cache_node, key).is_some() {
                r.cache_stopped = true;
                break;
            }
            let page = self.pool.cache_page(id, p).expect("a full page of its own, not cached yet");
            r.cache_node = self.cache.insert(r.cache_node, key, page, p < drafted);
            r.cache_pages += 1;
        }
        // its drafter has run over pages it cached (or took from the cache) without the
        // drafter's KV: mark them, walking up from its last cached page
        let upto = drafted.min(r.cache_pages);
        if upto > r.cache_drafter_pages {
            let (mut node, mut i) = (r.cache_node, r.cache_pages);
            while i > r.cache_drafter_pages {
                if i <= upto {
                    self.cache.set_drafter(node);
                }
                (_, node) = self.cache.page_and_parent(node);
                i -= 1;
            }
            r.cache_drafter_pages = upto;
        }
    }

    /// Checks the tree against the pool and the requests (part of `check_invariants`).
    pub(super) fn check_cache(&self) -> Result<(), String> {
        self.pool.check_holders()?;
        if self.cache.len() != self.pool.num_cached_pages() as usize {
            return Err(format!(
                "the tree has {} pages, the pool {} cached",
                self.cache.len(),
                self.pool.num_cached_pages()
            ));
        }
        for (_, page) in self.cache.entries() {
            if self.pool.holders(page).is_none() {
                return Err(format!("tree page {page} is not cached in the pool"));
            }
        }
        for id in &self.admitted {
            let r: &Request = &self.requests[id];
            let pages = self.pool.pages(*id).map_err(|e| e.to_string())?;
            let (mut node, mut i) = (r.cache_node, r.cache_pages);
            while node != ROOT {
                let (page, parent) = self.cache.page_and_parent(node);
                if i == 0 || pages[i - 1] != page {
                    return Err(format!("request {id}: its cached pages are not its tree path"));
                }
                (node, i) = (parent, i - 1);
            }
            if i != 0 {
                return Err(format!("request {id}: {} cached pages, a shorter tree path", r.cache_pages));
            }
            let path: Vec<usize> = {
                let (mut node, mut path) = (r.cache_node, Vec::new());
                while node != ROOT {
                    path.push(node);
                    node = self.cache.page_and_parent(node).1;
                }
                path.reverse();
                path
            };
            if self.cache.drafter_pages(&path) < r.cache_drafter_pages {
                return Err(format!("request {id}: {} drafter pages, fewer marked on its path", r.cache_drafter_pages));
            }
        }
        Ok(())
    }
}

//! The prefix cache's index: a radix tree over full KV pages.
//!
//! Each node below the root is one cached page: the `page_size` token ids it holds (its edge
//! key) and its page id; a node's parent is the page before it, so the path from the root
//! spells a token prefix page by page. A request whose tokens start with such a path can take
//! those pages instead of prefilling them (SGLang's RadixAttention with `page_size > 1`, vLLM's
//! automatic prefix caching).
//!
//! Why a tree with exact token keys rather than vLLM's hash-chained blocks: a page is found by
//! its tokens, never by a hash, so a collision cannot hand a request someone else's KV
//! (losslessness does not rest on a hash), and eviction goes leaf first for free (a parent page
//! is only useful with its children gone). Edges are whole pages because the KV pool shares
//! whole pages only: a partly filled page is still being written by its request.
//!
//! The tree only indexes; the [`PagePool`](crate::kv::PagePool) counts each cached page's
//! holders. A request holding a cached page holds every page before it (it took them from the
//! root down, or cached its own pages in order), so the pages no request holds form whole
//! subtrees: evicting least recently used leaves first can free every one of them.
//!
//! Each node also says whether its page carries the drafter's KV (`drafter`): the target's KV
//! of a committed page is always there, the drafter's only once some request's drafter has run
//! over its positions (a request decoding at steps 0 with the draft extend skipped caches pages
//! its drafter has not reached). Along a request's path the marked pages come first.

use std::collections::{BinaryHeap, HashMap};
use std::cmp::Reverse;

/// The root's node id (it holds no page).
pub const ROOT: usize = 0;

#[derive(Debug, Clone)]
struct Node {
    parent: usize,
    /// The page's token ids (the edge from `parent`).
    key: Vec<i64>,
    page: u32,
    children: HashMap<Vec<i64>, usize>,
    /// Logical time of the last match or insert that used it (LRU).
    last_used: u64,
    /// Its page carries the drafter's KV (and the EAGLE features) of its positions too.
    drafter: bool,
}

/// A radix tree over full pages (see the [module docs](self)). Node ids are reused after
/// eviction; node [`ROOT`] is the root.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    page_size: usize,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<usize>,
    clock: u64,
}

impl PrefixCache {
    /// An empty tree over pages of `page_size >= 1` tokens.
    pub fn new(page_size: u32) -> Self {
        let root = Node {
            parent: ROOT,
            key: Vec::new(),
            page: u32::MAX,
            children: HashMap::new(),
            last_used: 0,
            drafter: true,
        };
        PrefixCache { page_size: page_size.max(1) as usize, nodes: vec![Some(root)], free_ids: Vec::new(), clock: 0 }
    }

    /// Pages in the tree.
    pub fn len(&self) -> usize {
        self.nodes.len() - 1 - self.free_ids.len()
    }

    /// Whether no page is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("a live node id")
    }

    /// The longest cached prefix of `tokens`, at most `max_pages` pages: the node ids from the
    /// first page on. Marks them used now (LRU).
    pub fn match_prefix(&mut self, tokens: &[i64], max_pages: usize) -> Vec<usize> {
        self.clock += 1;
        let mut out = Vec::new();
        let mut at = ROOT;
        for key in tokens.chunks_exact(self.page_size).take(max_pages) {
            let Some(&child) = self.node(at).children.get(key) else { break };
            self.nodes[child].as_mut().expect("live").last_used = self.clock;
            out.push(child);
            at = child;
        }
        out
    }

    /// Pages of the longest cached prefix of `tokens`, at most `max_pages` (a lookup that does
    /// not count as a use).
    pub fn match_len(&self, tokens: &[i64], max_pages: usize) -> usize {
        let mut at = ROOT;
        let mut n = 0;
        for key in tokens.chunks_exact(self.page_size).take(max_pages) {
            let Some(&child) = self.node(at).children.get(key) else { break };
            at = child;
            n += 1;
        }
        n
    }

    /// How many of `nodes` (a path from the root, as [`match_prefix`](Self::match_prefix)
    /// returns) carry the drafter's KV, counted from the first until one does not.
    pub fn drafter_pages(&self, nodes: &[usize]) -> usize {
        nodes.iter().take_while(|&&n| self.node(n).drafter).count()
    }

    /// Marks node `id`'s page as carrying the drafter's KV (a request's drafter has run over
    /// its positions, writing the drafter's KV into the page's slots).
    pub fn set_drafter(&mut self, id: usize) {
        self.nodes[id].as_mut().expect("a live node id").drafter = true;
    }

    /// Whether node `id`'s page carries the drafter's KV.
    pub fn has_drafter(&self, id: usize) -> bool {
        self.node(id).drafter
    }

    /// Page ids of `nodes`.
    pub fn pages(&self, nodes: &[usize]) -> Vec<u32> {
        nodes.iter().map(|&n| self.node(n).page).collect()
    }

    /// The page of node `id` and its parent.
    pub fn page_and_parent(&self, id: usize) -> (u32, usize) {
        let n = self.node(id);
        (n.page, n.parent)
    }

    /// The child of `parent` with `key` (one page of tokens), if cached.
    pub fn child(&self, parent: usize, key: &[i64]) -> Option<usize> {
        self.node(parent).children.get(key).copied()
    }

    /// Adds `page` holding `key` (`page_size` tokens) under `parent`; returns its node id.
    /// `drafter`: the page carries the drafter's KV too. The caller checked with
    /// [`child`](Self::child) that `parent` has no such child.
    pub fn insert(&mut self, parent: usize, key: &[i64], page: u32, drafter: bool) -> usize {
        debug_assert_eq!(key.len(), self.page_size);
        debug_assert!(self.child(parent, key).is_none());
        self.clock += 1;
        let node = Node { parent, key: key.to_vec(), page, children: HashMap::new(), last_used: self.clock, drafter };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        self.nodes[parent].as_mut().expect("live parent").children.insert(key.to_vec(), id);
        id
    }

    /// Removes up to `n` leaves whose page `evictable` says no request holds, least recently
    /// used first (a parent whose last child goes becomes a candidate), and returns their pages.
    pub fn evict(&mut self, n: usize, evictable: impl Fn(u32) -> bool) -> Vec<u32> {
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = self
            .nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(id, n)| n.as_ref().map(|n| (id, n)))
            .filter(|(_, n)| n.children.is_empty() && evictable(n.page))
            .map(|(id, n)| Reverse((n.last_used, id)))
            .collect();
        let mut out = Vec::new();
        while out.len() < n {
            let Some(Reverse((_, id))) = heap.pop() else { break };
            let node = self.nodes[id].take().expect("a live leaf");
            self.free_ids.push(id);
            let parent = self.nodes[node.parent].as_mut().expect("live parent");
            parent.children.remove(&node.key);
            if node.parent != ROOT && parent.children.is_empty() && evictable(parent.page) {
                heap.push(Reverse((parent.last_used, node.parent)));
            }
            out.push(node.page);
        }
        out
    }

    /// Empties the tree and returns every page it held.
    pub fn clear(&mut self) -> Vec<u32> {
        let pages = self.nodes.iter().skip(1).flatten().map(|n| n.page).collect();
        *self = PrefixCache::new(self.page_size as u32);
        pages
    }

    /// Every cached page with its node id and its path's token count (for invariant checks).
    pub fn entries(&self) -> Vec<(usize, u32)> {
        self.nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(id, n)| n.as_ref().map(|n| (id, n.page)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_whole_pages_along_the_path() {
        let mut t = PrefixCache::new(2);
        let a = t.insert(ROOT, &[1, 2], 7, true);
        let b = t.insert(a, &[3, 4], 8, true);
        let c = t.insert(a, &[3, 5], 9, false);
        assert_eq!(t.len(), 3);
        assert_eq!(t.match_prefix(&[1, 2, 3, 4, 6], 9), vec![a, b]);
        assert_eq!(t.match_prefix(&[1, 2, 3, 5], 9), vec![a, c]);
        assert_eq!(t.match_prefix(&[1, 2, 3, 5], 1), vec![a]);
        assert_eq!(t.match_prefix(&[1, 2, 3], 9), vec![a]); // a partial page never matches
        assert_eq!(t.match_prefix(&[2, 2, 3, 4], 9), Vec::<usize>::new());
        assert_eq!(t.pages(&[a, c]), vec![7, 9]);
        assert_eq!((t.drafter_pages(&[a, b]), t.drafter_pages(&[a, c])), (2, 1));
        t.set_drafter(c);
        assert_eq!(t.drafter_pages(&[a, c]), 2);
    }

    #[test]
    fn evicts_least_recently_used_leaves_first() {
        let mut t = PrefixCache::new(1);
        let a = t.insert(ROOT, &[1], 10, true);
        let _b = t.insert(a, &[2], 11, true);
        let _c = t.insert(ROOT, &[3], 12, true);
        t.match_prefix(&[1, 2], 9); // a and b used after c
        assert_eq!(t.evict(1, |_| true), vec![12]);
        // b goes before its parent a; page 10 is held by a request: kept.
        assert_eq!(t.evict(5, |p| p != 10), vec![11]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.evict(5, |_| true), vec![10]);
        assert!(t.is_empty());
        // ids are reused
        let d = t.insert(ROOT, &[4], 13, true);
        assert!(d <= 3);
        assert_eq!(t.clear(), vec![13]);
    }
}

//! The driver's prefix cache: KV pages of token prefixes kept after their sequences end, so a
//! request whose prompt begins with the same tokens (a system prompt, a conversation sent
//! again with one more turn, a few-shot preamble) reads them instead of running them again.
//!
//! Only whole pages are kept: page `j` of a sequence holds positions `j*PAGE..(j+1)*PAGE`, and
//! its keys and values depend on those tokens and every token before them. So a cached page
//! is known by its tokens and its parent (the cached page before it; [`ROOT`] for a first
//! page): the key is exact, no hash stands for the tokens, and two prefixes share a page only
//! where all their tokens up to its end are the same.
//!
//! A page is held by the running sequences whose tables list it (`refs`); one held by none is
//! idle and stays cached until its page is wanted for a new sequence: then idle pages go,
//! the least recently used first, always a page no cached page follows (a leaf), so no cached
//! page ever names a parent that has gone. A sequence holds every page of its chain from the
//! first (what it matched, then what it registered, or where another sequence had registered
//! the same tokens first, that one's page: [`PrefixCache::hold`]), so an idle page has only
//! idle pages after it and every idle page can be reclaimed.
//!
//! It owns page bookkeeping only: which pages the driver hands out is the scheduler's, what
//! the pages hold is every rank's [`crate::model::KvCache`]. Nothing here allocates after
//! [`PrefixCache::new`] but [`PrefixCache::reclaim`], under memory pressure.

use crate::model::PAGE;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// The parent of a sequence's first page.
pub(super) const ROOT: u32 = u32::MAX;

/// A cached page's identity: its parent page and its tokens.
type Key = (u32, [u32; PAGE]);

struct Entry {
    key: Key,
    /// Running sequences whose tables list it.
    refs: u32,
    /// Cached pages whose parent it is.
    children: u32,
    /// When a sequence last took or let go of it (the cache's clock).
    used: u64,
}

pub(super) struct PrefixCache {
    pages: HashMap<Key, u32>,
    /// By page: its entry, where the page is cached.
    entries: Vec<Option<Entry>>,
    /// Cached pages held by no sequence.
    idle: usize,
    clock: u64,
}

impl PrefixCache {
    /// A cache for a pool of `pages` pages (room for all of them made now).
    pub(super) fn new(pages: usize) -> Self {
        PrefixCache {
            pages: HashMap::with_capacity(pages),
            entries: (0..pages).map(|_| None).collect(),
            idle: 0,
            clock: 0,
        }
    }

    /// Cached pages held by no running sequence: reclaimable.
    pub(super) fn idle(&self) -> usize {
        self.idle
    }

    /// Into `found` (cleared first), the cached pages of the longest run of whole pages
    /// `tokens` begins with, at most `max_pages` of them, first page first.
    pub(super) fn lookup(&self, tokens: &[u32], max_pages: usize, found: &mut Vec<u32>) {
        found.clear();
        let mut parent = ROOT;
        for block in tokens.chunks_exact(PAGE).take(max_pages) {
            let key = (parent, block.try_into().expect("chunks of PAGE tokens"));
            match self.pages.get(&key) {
                Some(&page) => {
                    found.push(page);
                    parent = page;
                }
                None => break,
            }
        }
    }

    /// Of `pages` (a [`PrefixCache::lookup`]), those no sequence holds now.
    pub(super) fn idle_among(&self, pages: &[u32]) -> usize {
        pages.iter().filter(|&&p| self.entry(p).refs == 0).count()
    }

    /// A sequence holds `pages`: the cached pages its table begins with (a
    /// [`PrefixCache::lookup`]), or one it found registered in place of its own.
    pub(super) fn hold(&mut self, pages: &[u32]) {
        self.clock += 1;
        for &p in pages {
            let clock = self.clock;
            let e = self.entry_mut(p);
            e.refs += 1;
            e.used = clock;
            if e.refs == 1 {
                self.idle -= 1;
            }
        }
    }

    /// Page `page` of a running sequence now holds `block`, after its cached page `parent`
    /// ([`ROOT`] for its first page): cached, and held by the sequence, unless the same
    /// tokens after the same parent are cached already (another sequence ran them at the
    /// same time), whose page is returned instead (`page` stays the sequence's own; the
    /// sequence may hold that one and register its later pages after it).
    pub(super) fn register(&mut self, parent: u32, block: &[u32; PAGE], page: u32) -> Result<(), u32> {
        let key = (parent, *block);
        if let Some(&there) = self.pages.get(&key) {
            return Err(there);
        }
        debug_assert!(self.entries[page as usize].is_none(), "page {page} is cached twice");
        self.clock += 1;
        self.pages.insert(key, page);
        self.entries[page as usize] = Some(Entry { key, refs: 1, children: 0, used: self.clock });
        if parent != ROOT {
            self.entry_mut(parent).children += 1;
        }
        Ok(())
    }

    /// A sequence with table `pages` ended: its cached pages lose a holder (idle when it was
    /// the last); `free` gets the others, last first (so a stack of free pages hands them out
    /// again in table order).
    pub(super) fn release(&mut self, pages: &[u32], mut free: impl FnMut(u32)) {
        self.clock += 1;
        let clock = self.clock;
        for &p in pages.iter().rev() {
            match self.entries[p as usize].as_mut() {
                Some(e) => {
                    e.refs -= 1;
                    e.used = clock;
                    if e.refs == 0 {
                        self.idle += 1;
                    }
                }
                None => free(p),
            }
        }
    }

    /// Takes `want` idle pages out of the cache (all of them, if fewer are idle), the least
    /// recently used leaves first, and gives each to `free`.
    pub(super) fn reclaim(&mut self, want: usize, mut free: impl FnMut(u32)) {
        let leaf = |e: &Entry| e.refs == 0 && e.children == 0;
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = (self.entries.iter().enumerate())
            .filter_map(|(p, e)| e.as_ref().filter(|e| leaf(e)).map(|e| Reverse((e.used, p as u32))))
            .collect();
        let mut taken = 0;
        while taken < want {
            let Some(Reverse((_, page))) = heap.pop() else { break };
            let e = self.entries[page as usize].take().expect("a leaf in the heap is cached");
            self.pages.remove(&e.key);
            self.idle -= 1;
            taken += 1;
            free(page);
            let parent = e.key.0;
            if parent != ROOT {
                let p = self.entry_mut(parent);
                p.children -= 1;
                if leaf(p) {
                    heap.push(Reverse((p.used, parent)));
                }
            }
        }
    }

    fn entry(&self, page: u32) -> &Entry {
        self.entries[page as usize].as_ref().expect("a cached page")
    }

    fn entry_mut(&mut self, page: u32) -> &mut Entry {
        self.entries[page as usize].as_mut().expect("a cached page")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` pages of tokens: page `j` holds `base + j` at every position.
    fn tokens(base: u32, n: usize) -> Vec<u32> {
        (0..n * PAGE).map(|i| base + (i / PAGE) as u32).collect()
    }

    fn lookup(c: &PrefixCache, t: &[u32], max_pages: usize) -> Vec<u32> {
        let mut found = vec![7; 3];
        c.lookup(t, max_pages, &mut found);
        found
    }

    fn block(t: &[u32], j: usize) -> [u32; PAGE] {
        t[j * PAGE..(j + 1) * PAGE].try_into().unwrap()
    }

    /// Registers `t`'s pages as `pages` (a sequence's table), returning the cache.
    fn register_all(c: &mut PrefixCache, t: &[u32], pages: &[u32]) {
        let mut parent = ROOT;
        for (j, &p) in pages.iter().enumerate() {
            c.register(parent, &block(t, j), p).unwrap();
            parent = p;
        }
    }

    #[test]
    fn a_prefix_is_found_by_all_its_tokens_and_its_whole_pages_only() {
        let mut c = PrefixCache::new(16);
        let a = tokens(10, 3);
        register_all(&mut c, &a, &[4, 5, 6]);
        assert_eq!(lookup(&c, &a, 9), [4, 5, 6]);
        assert_eq!(lookup(&c, &a, 2), [4, 5]);
        // A partial page is not a page.
        assert_eq!(lookup(&c, &a[..2 * PAGE + 3], 9), [4, 5]);
        // One token changed in the second page: only the first matches, and the same second
        // page's tokens after another first page match nothing.
        let mut b = a.clone();
        b[PAGE + 7] = 99;
        assert_eq!(lookup(&c, &b, 9), [4]);
        let mut d = a.clone();
        d[0] = 99;
        assert_eq!(lookup(&c, &d, 9), Vec::<u32>::new());
        // The same tokens cached again are refused, naming the page that has them.
        assert_eq!(c.register(ROOT, &block(&a, 0), 9), Err(4));
        assert!(c.entries[9].is_none());
    }

    #[test]
    fn idle_pages_go_least_recently_used_leaves_first() {
        let mut c = PrefixCache::new(16);
        let (a, b) = (tokens(10, 3), tokens(40, 2));
        register_all(&mut c, &a, &[0, 1, 2]);
        register_all(&mut c, &b, &[3, 4]);
        // Both sequences end: `a`'s pages first, then `b`'s, with a private page each.
        let mut freed = Vec::new();
        c.release(&[0, 1, 2, 7], |p| freed.push(p));
        c.release(&[3, 4, 8], |p| freed.push(p));
        assert_eq!((freed.as_slice(), c.idle()), (&[7, 8][..], 5));
        // A sequence takes `a`'s first two pages: they are held, not idle.
        let hit = lookup(&c, &a, 2);
        assert_eq!((c.idle_among(&hit), hit.as_slice()), (2, &[0, 1][..]));
        c.hold(&hit);
        assert_eq!(c.idle(), 3);
        // Reclaiming takes `a`'s leaf (page 2, the oldest), then `b`'s leaf and its parent;
        // never the held pages.
        freed.clear();
        c.reclaim(2, |p| freed.push(p));
        assert_eq!(freed, [2, 4]);
        c.reclaim(9, |p| freed.push(p));
        assert_eq!((freed.as_slice(), c.idle()), (&[2, 4, 3][..], 0));
        assert_eq!(lookup(&c, &a, 9), [0, 1]);
        assert_eq!(lookup(&c, &b, 9), Vec::<u32>::new());
        // Released again, the held pages can go too, the leaf before its parent.
        c.release(&[0, 1], |_| unreachable!("both are cached"));
        freed.clear();
        c.reclaim(9, |p| freed.push(p));
        assert_eq!(freed, [1, 0]);
        assert!(c.pages.is_empty());
    }

    /// Two sequences ran the same first page at once: the second finds the first's registered,
    /// holds it and registers its own later page after it (as the scheduler does). A lookup
    /// then follows the first's page into the second's; no page goes while either holds it,
    /// and once both end every page is idle and reclaimable, leaves first.
    #[test]
    fn a_page_found_registered_is_held_and_followed() {
        let mut c = PrefixCache::new(16);
        let (a, b) = (tokens(10, 2), [tokens(10, 1), tokens(50, 1)].concat());
        register_all(&mut c, &a, &[0, 1]);
        // `b` ran its first page as page 5: page 0 has those tokens.
        assert_eq!(c.register(ROOT, &block(&b, 0), 5), Err(0));
        c.hold(&[0]);
        c.register(0, &block(&b, 1), 6).unwrap();
        assert_eq!(lookup(&c, &b, 9), [0, 6]);
        // `a` ends: page 0 is still held by `b`.
        c.release(&[0, 1], |_| unreachable!("both are cached"));
        assert_eq!(c.idle(), 1);
        let mut freed = Vec::new();
        c.reclaim(9, |p| freed.push(p));
        assert_eq!(freed, [1]);
        // `b` ends: its own first page (never cached) is freed, and its chain goes idle.
        c.release(&[5, 6], |p| freed.push(p));
        c.release(&[0], |_| unreachable!("page 0 is cached"));
        assert_eq!((freed.as_slice(), c.idle()), (&[1, 5][..], 2));
        c.reclaim(9, |p| freed.push(p));
        assert_eq!(freed, [1, 5, 6, 0]);
        assert!(c.pages.is_empty());
    }
}

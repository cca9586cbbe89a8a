//! A map keyed by message handles (`handles.rs`), built for batches: a lease enters its
//! messages and a trim removes its acked ones, hundreds or thousands at a time, in a map
//! of hundreds of thousands. Its slots are 8 bytes (a 32-bit hash tag and where the
//! entry is), so the slot array of such a map (a few MB) mostly fits in the last-level
//! cache, where its entries (32 bytes each) do not: a probe reads an entry only when the
//! tag matches. A batch first reads each handle's first slot, then each entry those
//! name, in passes of independent loads, so the CPU overlaps the misses instead of
//! waiting each out in turn (as `ids::find_slots` does).
//! A slot alone says where its handle's probe starts (its tag's low bits), so resizing
//! or cleaning the slots reads no entry.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

const EMPTY: u64 = 0;
const DELETED: u64 = u64::MAX;
const MIN_SLOTS: usize = 16;

/// Message handle -> `V`. Linear probing over `slots` from each tag's home; an entry
/// keeps its place in `entries` (freed places are reused) until the map packs them, once
/// a quarter or fewer are held: its memory follows what it holds, not the most it ever
/// held.
pub(crate) struct IdMap<V> {
    // foldhash, seeded at random per process, as the index's id table is (`ids.rs`):
    // anyone can compute a message's handle, so its bits cannot be positions, or ids
    // could be chosen to collide on every node.
    hasher: RandomState,
    slots: Vec<u64>, // EMPTY, DELETED, or tag << 32 | (entry + 1)
    entries: Vec<Option<(u128, V)>>,
    free: Vec<u32>, // places in `entries` that hold nothing
    live: usize,
    used: usize, // slots not EMPTY: live and DELETED
}

impl<V> Default for IdMap<V> {
    fn default() -> Self {
        Self {
            hasher: RandomState::default(),
            slots: vec![EMPTY; MIN_SLOTS],
            entries: Vec::new(),
            free: Vec::new(),
            live: 0,
            used: 0,
        }
    }
}

/// A held slot: its id's tag (the hash's high half) and its entry + 1, from 1 to
/// 2^32 - 2, so no held slot reads as EMPTY or DELETED.
fn slot(tag: u64, e: usize) -> u64 {
    tag << 32 | (e as u64 + 1)
}

fn entry_of(s: u64) -> usize {
    (s & 0xFFFF_FFFF) as usize - 1
}

fn held(s: u64) -> bool {
    s != EMPTY && s != DELETED
}

impl<V> IdMap<V> {
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// The handle's tag: the high half of its hash.
    fn tag(&self, key: u128) -> u64 {
        self.hasher.hash_one(key) >> 32
    }

    fn home(&self, tag: u64) -> usize {
        tag as usize & (self.slots.len() - 1)
    }

    /// The slot holding `key` and its entry, if held.
    fn find(&self, key: u128, tag: u64) -> Option<(usize, usize)> {
        let mask = self.slots.len() - 1;
        let mut i = self.home(tag);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            if held(s) && s >> 32 == tag {
                let e = entry_of(s);
                if let Some((id, _)) = &self.entries[e] {
                    if *id == key {
                        return Some((i, e));
                    }
                }
            }
            i = (i + 1) & mask;
        }
    }

    pub(crate) fn contains_key(&self, key: u128) -> bool {
        self.find(key, self.tag(key)).is_some()
    }

    pub(crate) fn get(&self, key: u128) -> Option<&V> {
        let (_, e) = self.find(key, self.tag(key))?;
        self.entries[e].as_ref().map(|(_, v)| v)
    }

    /// Enter `key` unless it is held: whether it was entered (else `value` is dropped).
    pub(crate) fn add(&mut self, key: u128, value: V) -> bool {
        self.add_tagged(key, self.tag(key), value)
    }

    /// `add` with the tag `warm` gave.
    pub(crate) fn add_tagged(&mut self, key: u128, tag: u64, value: V) -> bool {
        if self.find(key, tag).is_some() {
            return false;
        }
        self.put(key, tag, value);
        true
    }

    /// Enter `key` with `value`, replacing what it held.
    pub(crate) fn insert(&mut self, key: u128, value: V) {
        let tag = self.tag(key);
        match self.find(key, tag) {
            Some((_, e)) => {
                if let Some((_, v)) = &mut self.entries[e] {
                    *v = value;
                }
            }
            None => self.put(key, tag, value),
        }
    }

    /// Enter `key`, known not to be held.
    fn put(&mut self, key: u128, tag: u64, value: V) {
        self.reserve(1);
        let entry = Some((key, value));
        let e = match self.free.pop() {
            Some(e) => {
                self.entries[e as usize] = entry;
                e as usize
            }
            None => {
                assert!(
                    self.entries.len() + 1 < u32::MAX as usize,
                    "an id map holds at most 2^32 - 2 entries"
                );
                self.entries.push(entry);
                self.entries.len() - 1
            }
        };
        let mask = self.slots.len() - 1;
        let mut i = self.home(tag);
        while held(self.slots[i]) {
            i = (i + 1) & mask;
        }
        if self.slots[i] == EMPTY {
            self.used += 1;
        }
        self.slots[i] = slot(tag, e);
        self.live += 1;
    }

    /// Remove `key`: its value, if it was held.
    pub(crate) fn remove(&mut self, key: u128) -> Option<V> {
        self.remove_tagged(key, self.tag(key))
    }

    /// `remove` with the tag `warm` gave.
    pub(crate) fn remove_tagged(&mut self, key: u128, tag: u64) -> Option<V> {
        let (i, e) = self.find(key, tag)?;
        let mask = self.slots.len() - 1;
        // A slot followed by an empty one ends every probe that reaches it: it can be
        // empty itself. Otherwise it is marked, so probes go on past it.
        if self.slots[(i + 1) & mask] == EMPTY {
            self.slots[i] = EMPTY;
            self.used -= 1;
        } else {
            self.slots[i] = DELETED;
        }
        self.live -= 1;
        let (_, value) = self.entries[e].take().expect("a slot names a held entry");
        self.free.push(e as u32);
        if self.entries.len() > 4096 && self.live * 4 < self.entries.len() {
            self.pack();
        }
        Some(value)
    }

    /// Slots for `room` entries at most a quarter full, each placed again from its
    /// tag's home: no entry is read, and no DELETED slot is left.
    fn resize(&mut self, room: usize) {
        let size = (room.max(1) * 4).next_power_of_two().max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; size]);
        let mask = size - 1;
        for s in old.into_iter().filter(|&s| held(s)) {
            let mut i = self.home(s >> 32);
            while self.slots[i] != EMPTY {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
        self.used = self.live;
    }

    /// The held entries moved to the front of `entries`, in their order, and the slots
    /// renumbered to match.
    fn pack(&mut self) {
        let mut moved_to = vec![u32::MAX; self.entries.len()];
        let mut next = 0u32;
        for (e, entry) in self.entries.iter().enumerate() {
            if entry.is_some() {
                moved_to[e] = next;
                next += 1;
            }
        }
        self.entries.retain(Option::is_some);
        self.entries.shrink_to(self.live * 2);
        self.free = Vec::new();
        for s in self.slots.iter_mut().filter(|s| held(**s)) {
            *s = slot(*s >> 32, moved_to[entry_of(*s)] as usize);
        }
        self.resize(self.live);
    }

    /// Each id's tag, with its first slot and any entry that slot names read in two
    /// passes of independent loads: the batch's misses overlap.
    pub(crate) fn warm(&self, keys: &[u128]) -> Vec<u64> {
        let tags: Vec<u64> = keys.iter().map(|&key| self.tag(key)).collect();
        let firsts: Vec<u64> = tags.iter().map(|&t| self.slots[self.home(t)]).collect();
        let mut touched = 0usize;
        for (&s, &t) in firsts.iter().zip(&tags) {
            if held(s) && s >> 32 == t {
                if let Some((id, _)) = &self.entries[entry_of(s)] {
                    touched ^= *id as usize;
                }
            }
        }
        std::hint::black_box(touched);
        tags
    }

    /// Room for `more` entries without resizing in between.
    pub(crate) fn reserve(&mut self, more: usize) {
        if (self.used + more) * 8 > self.slots.len() * 5 {
            self.resize(self.live + more);
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u128, &V)> {
        self.entries.iter().flatten().map(|(id, v)| (*id, v))
    }
}

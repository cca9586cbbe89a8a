//! A map keyed by message ids' bytes, built for batches: a lease enters its ids and a
//! trim removes its acked ones, hundreds or thousands at a time, in a map of hundreds of
//! thousands. Its slots are 8 bytes (a 32-bit hash tag and where the entry is), so the
//! slot array of such a map (a few MB) mostly fits in the last-level cache, where its
//! entries (48 bytes each) do not: a probe reads an entry only when the tag matches. A
//! batch first reads each id's first slot, then each entry those name, in passes of
//! independent loads, so the CPU overlaps the misses instead of waiting each out in turn
//! (as `ids::find_slots` does).
//! A slot alone says where its id's probe starts (its tag's low bits), so resizing or
//! cleaning the slots reads no entry.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

/// Bytes of an id held inline; longer ones go on the heap. Most ids fit, and entering
/// one then allocates nothing.
const INLINE: usize = 38;
const EMPTY: u64 = 0;
const DELETED: u64 = u64::MAX;
const MIN_SLOTS: usize = 16;

/// A message id's UTF-8 bytes, as the map holds them.
pub(crate) enum Id {
    Short(u8, [u8; INLINE]),
    Long(Box<[u8]>),
}

impl Id {
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Id::Short(len, bytes) => &bytes[..*len as usize],
            Id::Long(raw) => raw,
        }
    }
}

impl From<&[u8]> for Id {
    fn from(raw: &[u8]) -> Self {
        if raw.len() <= INLINE {
            let mut bytes = [0u8; INLINE];
            bytes[..raw.len()].copy_from_slice(raw);
            Id::Short(raw.len() as u8, bytes)
        } else {
            Id::Long(raw.into())
        }
    }
}

/// Id -> `V`. Linear probing over `slots` from each tag's home; an entry keeps its place
/// in `entries` (freed places are reused) until the map packs them, once a quarter or
/// fewer are held: its memory follows what it holds, not the most it ever held.
pub(crate) struct IdMap<V> {
    // foldhash, seeded at random per process, as the index's id table is
    // (`ids.rs`): producers choose the ids, and cannot choose ones that collide on a
    // node without its seed.
    hasher: RandomState,
    slots: Vec<u64>, // EMPTY, DELETED, or tag << 32 | (entry + 1)
    entries: Vec<Option<(Id, V)>>,
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

    /// The id's tag: the high half of its hash.
    fn tag(&self, raw: &[u8]) -> u64 {
        self.hasher.hash_one(raw) >> 32
    }

    fn home(&self, tag: u64) -> usize {
        tag as usize & (self.slots.len() - 1)
    }

    /// The slot holding `raw` and its entry, if held.
    fn find(&self, raw: &[u8], tag: u64) -> Option<(usize, usize)> {
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
                    if id.as_bytes() == raw {
                        return Some((i, e));
                    }
                }
            }
            i = (i + 1) & mask;
        }
    }

    pub(crate) fn contains_key(&self, raw: &[u8]) -> bool {
        self.find(raw, self.tag(raw)).is_some()
    }

    pub(crate) fn get(&self, raw: &[u8]) -> Option<&V> {
        let (_, e) = self.find(raw, self.tag(raw))?;
        self.entries[e].as_ref().map(|(_, v)| v)
    }

    /// Enter `raw` unless it is held: whether it was entered (else `value` is dropped).
    pub(crate) fn add(&mut self, raw: &[u8], value: V) -> bool {
        self.add_tagged(raw, self.tag(raw), value)
    }

    /// `add` with the tag `warm` gave.
    pub(crate) fn add_tagged(&mut self, raw: &[u8], tag: u64, value: V) -> bool {
        if self.find(raw, tag).is_some() {
            return false;
        }
        self.put(raw, tag, value);
        true
    }

    /// Enter `raw` with `value`, replacing what it held.
    pub(crate) fn insert(&mut self, raw: &[u8], value: V) {
        let tag = self.tag(raw);
        match self.find(raw, tag) {
            Some((_, e)) => {
                if let Some((_, v)) = &mut self.entries[e] {
                    *v = value;
                }
            }
            None => self.put(raw, tag, value),
        }
    }

    /// Enter `raw`, known not to be held.
    fn put(&mut self, raw: &[u8], tag: u64, value: V) {
        self.reserve(1);
        let entry = Some((Id::from(raw), value));
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

    /// Remove `raw`: its value, if it was held.
    pub(crate) fn remove(&mut self, raw: &[u8]) -> Option<V> {
        self.remove_tagged(raw, self.tag(raw))
    }

    /// `remove` with the tag `warm` gave.
    pub(crate) fn remove_tagged(&mut self, raw: &[u8], tag: u64) -> Option<V> {
        let (i, e) = self.find(raw, tag)?;
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
    pub(crate) fn warm(&self, raws: &[&[u8]]) -> Vec<u64> {
        let tags: Vec<u64> = raws.iter().map(|raw| self.tag(raw)).collect();
        let firsts: Vec<u64> = tags.iter().map(|&t| self.slots[self.home(t)]).collect();
        let mut touched = 0usize;
        for (&s, &t) in firsts.iter().zip(&tags) {
            if held(s) && s >> 32 == t {
                if let Some((id, _)) = &self.entries[entry_of(s)] {
                    touched ^= id.as_bytes().len();
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

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&Id, &V)> {
        self.entries.iter().flatten().map(|(id, v)| (id, v))
    }
}

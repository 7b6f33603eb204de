//! The layout of a DCP (torch.distributed.checkpoint) output, planned without
//! an object per item: where every item goes, and the `.metadata` pickle.
//!
//! A DCP checkpoint of a large model has hundreds of thousands of items (one
//! per dim-0 shard of every tensor, at every rank), and its `.metadata` names
//! each of them. Planning them one Python object at a time took minutes at
//! 405B scale, so the item placement and the pickle are computed here from one
//! description per key ([`Leaf`]): the Python writer keeps the per-key facts
//! (the archive sizes of its few distinct shard shapes, its nesting) and
//! expands the items of one rank file only when that file is written.
//!
//! The placement is FSDP2's: a sharded tensor is cut on dim 0 in
//! `torch.chunk` sizes, `ceil(rows / N)` rows per rank; ranks past the data
//! share one empty item at offset `rows` (the first of them holds it); 0-d
//! tensors and non-tensor values go, after every shard, to the least loaded
//! rank. Items sit in each rank file in key order, back to back.
//!
//! The pickle is protocol 2 with a memo, and these bytes are exactly what the
//! Python pickler of `_torchwrite.dumps(memo=True)` writes for the same
//! objects (`tests/test_dcp_plan.py` checks it against the Python form kept
//! there as the oracle, and against torch's own classes).

use std::collections::HashMap;
use std::fmt;

/// One element of a key's nesting (`planner_data`): a dict key or a list index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathItem {
    Str(String),
    Int(i64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeafKind {
    /// A tensor of dim >= 1 cut on dim 0 across the ranks.
    Sharded,
    /// A tensor stored whole on one rank (a 0-d tensor, an RNG state).
    Whole,
    /// A non-tensor value, one pickled item.
    Bytes,
}

/// One key of the flattened state.
#[derive(Debug, Clone)]
pub struct Leaf {
    pub key: String,
    pub path: Vec<PathItem>,
    pub kind: LeafKind,
    /// torch's name of the dtype (`float32`); unused for [`LeafKind::Bytes`].
    pub dtype: String,
    pub shape: Vec<u64>,
    /// The item archive's size in bytes: for a sharded tensor, of a full shard
    /// (`ceil(rows / N)` rows), of the last, shorter one, and of the empty one;
    /// otherwise the first alone.
    pub totals: [u64; 3],
}

/// One item: where it is and which rows of its leaf it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    pub leaf: u32,
    /// The item's position in its key's chunk list.
    pub index: u32,
    pub rank: u32,
    pub offset: u64,
    pub total: u64,
    /// First row and row count (dim 0) of a sharded item; the whole tensor otherwise.
    pub row0: u64,
    pub rows: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutError(pub String);

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LayoutError {}

/// The items of every leaf, in key order (a key's items by rank), and each rank file's size.
pub fn place(leaves: &[Leaf], world_size: usize) -> Result<(Vec<Item>, Vec<u64>), LayoutError> {
    if world_size == 0 || world_size > u32::MAX as usize {
        return Err(LayoutError(format!(
            "world size {world_size} is out of range"
        )));
    }
    if leaves.len() > u32::MAX as usize {
        return Err(LayoutError("too many keys".into()));
    }
    for leaf in leaves {
        if leaf.shape.iter().any(|&d| d > i64::MAX as u64) {
            return Err(LayoutError(format!(
                "'{}': a dimension does not fit in 63 bits",
                leaf.key
            )));
        }
    }
    let ws = world_size as u64;
    let mut items: Vec<Item> = Vec::new();
    let mut load = vec![0u64; world_size];
    let mut floating: Vec<usize> = Vec::new();
    let overflow = || LayoutError("a rank file would pass 2**63 bytes".into());
    for (li, leaf) in leaves.iter().enumerate() {
        let li = li as u32;
        match leaf.kind {
            LeafKind::Sharded => {
                let rows = *leaf.shape.first().ok_or_else(|| {
                    LayoutError(format!("'{}': a sharded tensor needs dim >= 1", leaf.key))
                })?;
                let per = rows.div_ceil(ws);
                let mut last: Option<u64> = None;
                let mut index = 0u32;
                for r in 0..ws {
                    let start = r.saturating_mul(per).min(rows);
                    if last == Some(start) {
                        continue; // an equal box, recorded once
                    }
                    last = Some(start);
                    let size = start.saturating_add(per).min(rows) - start;
                    let total = if size == 0 {
                        leaf.totals[2]
                    } else if size == per {
                        leaf.totals[0]
                    } else {
                        leaf.totals[1]
                    };
                    load[r as usize] = load[r as usize].checked_add(total).ok_or_else(overflow)?;
                    items.push(Item {
                        leaf: li,
                        index,
                        rank: r as u32,
                        offset: 0,
                        total,
                        row0: start,
                        rows: size,
                    });
                    index += 1;
                }
            }
            LeafKind::Whole | LeafKind::Bytes => {
                floating.push(items.len());
                let rows = leaf.shape.first().copied().unwrap_or(0);
                items.push(Item {
                    leaf: li,
                    index: 0,
                    rank: u32::MAX,
                    offset: 0,
                    total: leaf.totals[0],
                    row0: 0,
                    rows,
                });
            }
        }
    }
    for i in floating {
        let mut best = 0;
        for r in 1..world_size {
            if load[r] < load[best] {
                best = r;
            }
        }
        items[i].rank = best as u32;
        load[best] = load[best]
            .checked_add(items[i].total)
            .ok_or_else(overflow)?;
    }
    let mut sizes = vec![0u64; world_size];
    for it in &mut items {
        let r = it.rank as usize;
        it.offset = sizes[r];
        sizes[r] = sizes[r]
            .checked_add(it.total)
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(overflow)?;
    }
    Ok((items, sizes))
}

/// The name of rank `r`'s data file, as `FileSystemWriter` names it.
pub fn file_name(rank: u32) -> String {
    format!("__{rank}_0.distcp")
}

const MD: &str = "torch.distributed.checkpoint.metadata";
const FS: &str = "torch.distributed.checkpoint.filesystem";
const DCP_VERSION: &str = "1.0.0"; // torch's CURRENT_DCP_VERSION (2.6 to 2.15)

/// Where the pickle goes: bytes, or only their count (the size of `.metadata`
/// at planning time, without holding it).
enum Out {
    Bytes(Vec<u8>),
    Count(usize),
}

impl Out {
    fn extend_from_slice(&mut self, b: &[u8]) {
        match self {
            Out::Bytes(v) => v.extend_from_slice(b),
            Out::Count(n) => *n += b.len(),
        }
    }

    fn push(&mut self, b: u8) {
        match self {
            Out::Bytes(v) => v.push(b),
            Out::Count(n) => *n += 1,
        }
    }
}

/// A protocol-2 pickle writer with a memo: each string and class name is
/// written once, then fetched (`BINPUT`/`BINGET`), numbered as Python's
/// pickler numbers them.
struct Pickler {
    out: Out,
    strs: HashMap<String, u32>,
    // the few class names, and the constant strings met once per item, by address:
    // a lookup without hashing (the memo entry itself is in `strs`, shared with equal strings)
    globals: Vec<(&'static str, String, u32)>,
    consts: Vec<(*const u8, u32)>,
    next: u32,
}

impl Pickler {
    fn new(out: Out) -> Self {
        let mut p = Pickler {
            out,
            strs: HashMap::new(),
            globals: Vec::new(),
            consts: Vec::new(),
            next: 0,
        };
        p.op(b"\x80\x02");
        p
    }

    fn put(&mut self) -> u32 {
        let idx = self.next;
        self.next += 1;
        if idx < 256 {
            self.out.extend_from_slice(&[b'q', idx as u8]);
        } else {
            self.out.push(b'r');
            self.out.extend_from_slice(&idx.to_le_bytes());
        }
        idx
    }

    fn get(&mut self, idx: u32) {
        if idx < 256 {
            self.out.extend_from_slice(&[b'h', idx as u8]);
        } else {
            self.out.push(b'j');
            self.out.extend_from_slice(&idx.to_le_bytes());
        }
    }

    fn op(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    fn global(&mut self, module: &'static str, name: &str) {
        if let Some(&(_, _, idx)) = self
            .globals
            .iter()
            .find(|(m, n, _)| *m == module && n == name)
        {
            return self.get(idx);
        }
        self.out.push(b'c');
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
        let idx = self.put();
        self.globals.push((module, name.to_string(), idx));
    }

    /// A constant string: [`Pickler::str`], remembered by address after its first use.
    fn key(&mut self, s: &'static str) {
        if let Some(&(_, idx)) = self.consts.iter().find(|(p, _)| *p == s.as_ptr()) {
            return self.get(idx);
        }
        let idx = self.str(s);
        self.consts.push((s.as_ptr(), idx));
    }

    /// A string, returning its memo index (callers may then fetch it with [`Pickler::get`]).
    fn str(&mut self, s: &str) -> u32 {
        if let Some(&idx) = self.strs.get(s) {
            self.get(idx);
            return idx;
        }
        self.out.push(b'X');
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
        let idx = self.put();
        self.strs.insert(s.to_string(), idx);
        idx
    }

    fn int(&mut self, v: i64) {
        if let Ok(small) = i32::try_from(v) {
            self.out.push(b'J');
            self.out.extend_from_slice(&small.to_le_bytes());
        } else {
            // LONG1, with Python's length: (bit_length + 8) // 8 bytes, two's complement
            let bits = 64 - v.unsigned_abs().leading_zeros(); // Python's int.bit_length()
            let n = (bits as usize + 8) / 8;
            self.out.extend_from_slice(&[0x8a, n as u8]);
            self.out
                .extend_from_slice(&i128::from(v).to_le_bytes()[..n]);
        }
    }

    fn ints(&mut self, vs: impl ExactSizeIterator<Item = i64>) {
        if vs.len() == 0 {
            return self.op(b")");
        }
        self.op(b"(");
        for v in vs {
            self.int(v);
        }
        self.op(b"t");
    }

    /// `torch.Size(dims)`.
    fn size(&mut self, dims: impl ExactSizeIterator<Item = i64>) {
        self.global("torch", "Size");
        self.op(b"(");
        self.ints(dims);
        self.op(b"tR");
    }

    /// `cls.__new__(cls)`: a dataclass instance, before its state.
    fn new_obj(&mut self, module: &'static str, name: &str) {
        self.global(module, name);
        self.op(b")\x81");
    }
}

fn ints(v: &[u64]) -> impl ExactSizeIterator<Item = i64> + '_ {
    v.iter().map(|&x| x as i64)
}

fn strides(shape: &[u64]) -> Vec<i64> {
    let mut out = vec![0i64; shape.len()];
    let mut acc: i64 = 1;
    for (i, &s) in shape.iter().enumerate().rev() {
        out[i] = acc;
        acc = acc.saturating_mul(s.max(1) as i64);
    }
    out
}

/// The `.metadata` of the output [`place`] lays out, as `FileSystemWriter.finish`
/// pickles torch 2.15's classes. `current`: `TensorProperties` with its `strides`
/// (torch >= 2.15 reads it), else with the five fields of torch 2.4 to 2.14.
pub fn metadata(
    leaves: &[Leaf],
    items: &[Item],
    current: bool,
    save_id: &str,
) -> Result<Vec<u8>, LayoutError> {
    let out = Out::Bytes(Vec::with_capacity(
        items.len() * 130 + leaves.len() * 200 + 4096,
    ));
    match pickle_metadata(leaves, items, current, save_id, out)? {
        Out::Bytes(v) => Ok(v),
        Out::Count(_) => unreachable!(),
    }
}

/// The length of [`metadata`]'s bytes, computed without holding them.
pub fn metadata_len(
    leaves: &[Leaf],
    items: &[Item],
    current: bool,
    save_id: &str,
) -> Result<usize, LayoutError> {
    match pickle_metadata(leaves, items, current, save_id, Out::Count(0))? {
        Out::Count(n) => Ok(n),
        Out::Bytes(v) => Ok(v.len()),
    }
}

fn pickle_metadata(
    leaves: &[Leaf],
    items: &[Item],
    current: bool,
    save_id: &str,
    out: Out,
) -> Result<Out, LayoutError> {
    let mut p = Pickler::new(out);
    let mut by_leaf: Vec<(usize, usize)> = vec![(0, 0); leaves.len()]; // items[start..stop] of each leaf
    let mut at = 0;
    while at < items.len() {
        let leaf = items[at].leaf as usize;
        let start = at;
        while at < items.len() && items[at].leaf as usize == leaf {
            at += 1;
        }
        by_leaf[leaf] = (start, at);
    }
    // an item's box: (offsets, sizes), dim 0 its rows for a sharded tensor, the whole tensor otherwise
    let (mut offsets, mut sizes): (Vec<i64>, Vec<i64>) = (Vec::new(), Vec::new());
    let box_of = |leaf: &Leaf, it: &Item, offsets: &mut Vec<i64>, sizes: &mut Vec<i64>| {
        offsets.clear();
        offsets.resize(leaf.shape.len(), 0);
        sizes.clear();
        sizes.extend(ints(&leaf.shape));
        if leaf.kind == LeafKind::Sharded {
            offsets[0] = it.row0 as i64;
            sizes[0] = it.rows as i64;
        }
    };
    let mut key_memo: Vec<u32> = Vec::with_capacity(leaves.len());
    p.new_obj(MD, "Metadata");
    p.op(b"}(");
    p.key("state_dict_metadata");
    p.op(b"}");
    if !leaves.is_empty() {
        p.op(b"(");
    }
    for (li, leaf) in leaves.iter().enumerate() {
        key_memo.push(p.str(&leaf.key));
        if leaf.kind == LeafKind::Bytes {
            p.new_obj(MD, "BytesStorageMetadata"); // no state: an empty dict pickles no BUILD
            continue;
        }
        p.new_obj(MD, "TensorStorageMetadata");
        p.op(b"}(");
        p.key("properties");
        p.new_obj(MD, "TensorProperties");
        p.op(b"(");
        p.global("torch", &leaf.dtype);
        p.global("torch", "strided");
        p.op(b"\x89");
        p.global(MD, "_MEM_FORMAT_ENCODING");
        p.op(b"(");
        p.int(0);
        p.op(b"tR\x89");
        if current {
            let s = strides(&leaf.shape);
            p.ints(s.into_iter());
        }
        p.op(b"tb");
        p.key("size");
        p.size(ints(&leaf.shape));
        p.key("chunks");
        p.op(b"]");
        let (start, stop) = by_leaf[li];
        if stop > start {
            p.op(b"(");
            for it in &items[start..stop] {
                box_of(leaf, it, &mut offsets, &mut sizes);
                p.new_obj(MD, "ChunkStorageMetadata");
                p.op(b"}(");
                p.key("offsets");
                p.size(offsets.iter().copied());
                p.key("sizes");
                p.size(sizes.iter().copied());
                p.op(b"ub");
            }
            p.op(b"e");
        }
        p.op(b"ub");
    }
    if !leaves.is_empty() {
        p.op(b"u");
    }
    p.key("planner_data");
    p.op(b"}");
    if !leaves.is_empty() {
        p.op(b"(");
        for (li, leaf) in leaves.iter().enumerate() {
            p.get(key_memo[li]);
            p.op(b"(");
            for item in &leaf.path {
                match item {
                    PathItem::Str(s) => {
                        p.str(s);
                    }
                    PathItem::Int(i) => p.int(*i),
                }
            }
            p.op(b"t");
        }
        p.op(b"u");
    }
    p.key("storage_data");
    p.op(b"}");
    let mut files: Vec<Option<u32>> = Vec::new();
    if !items.is_empty() {
        p.op(b"(");
        for it in items {
            let leaf = &leaves[it.leaf as usize];
            p.new_obj(MD, "MetadataIndex");
            p.op(b"}(");
            p.key("fqn");
            p.get(key_memo[it.leaf as usize]);
            p.key("index");
            if leaf.kind == LeafKind::Bytes {
                p.op(b"N");
            } else {
                p.int(i64::from(it.index));
                p.key("offset");
                box_of(leaf, it, &mut offsets, &mut sizes);
                p.size(offsets.iter().copied());
            }
            p.op(b"ub");
            p.new_obj(FS, "_StorageInfo");
            p.op(b"}(");
            p.key("relative_path");
            let r = it.rank as usize;
            if files.len() <= r {
                files.resize(r + 1, None);
            }
            match files[r] {
                Some(idx) => p.get(idx),
                None => files[r] = Some(p.str(&file_name(it.rank))),
            }
            p.key("offset");
            p.int(it.offset as i64);
            p.key("length");
            p.int(it.total as i64);
            p.op(b"ub");
        }
        p.op(b"u");
    }
    p.key("storage_meta");
    p.new_obj(MD, "StorageMeta");
    p.op(b"}(");
    p.key("checkpoint_id");
    p.op(b"N");
    p.key("save_id");
    p.str(save_id);
    p.key("load_id");
    p.op(b"N");
    p.key("modules");
    p.op(b"]ub");
    p.key("version");
    p.str(DCP_VERSION);
    p.op(b"ub.");
    Ok(p.out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sharded(key: &str, shape: &[u64], totals: [u64; 3]) -> Leaf {
        Leaf {
            key: key.into(),
            path: vec![PathItem::Str(key.into())],
            kind: LeafKind::Sharded,
            dtype: "float32".into(),
            shape: shape.to_vec(),
            totals,
        }
    }

    #[test]
    fn shards_follow_torch_chunk_and_record_one_empty_box() {
        // 5 rows over 4 ranks: 2, 2, 1, then one empty box at offset 5 on rank 3
        let (items, sizes) = place(&[sharded("w", &[5, 3], [100, 60, 10])], 4).unwrap();
        let got: Vec<_> = items
            .iter()
            .map(|i| (i.rank, i.row0, i.rows, i.total, i.index))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0, 2, 100, 0),
                (1, 2, 2, 100, 1),
                (2, 4, 1, 60, 2),
                (3, 5, 0, 10, 3)
            ]
        );
        assert_eq!(sizes, vec![100, 100, 60, 10]);
        // 2 rows over 4 ranks: ranks 2 and 3 share one empty item (rank 2 holds it)
        let (items, _) = place(&[sharded("w", &[2], [7, 0, 3])], 4).unwrap();
        assert_eq!(
            items
                .iter()
                .map(|i| (i.rank, i.row0, i.rows))
                .collect::<Vec<_>>(),
            vec![(0, 0, 1), (1, 1, 1), (2, 2, 0)]
        );
        // no rows at all: one empty item on rank 0
        let (items, _) = place(&[sharded("w", &[0, 4], [0, 0, 5])], 3).unwrap();
        assert_eq!(
            items
                .iter()
                .map(|i| (i.rank, i.row0, i.rows, i.total))
                .collect::<Vec<_>>(),
            vec![(0, 0, 0, 5)]
        );
    }

    #[test]
    fn floating_items_go_to_the_least_loaded_rank_and_keep_key_order_in_files() {
        let step = Leaf {
            key: "s".into(),
            path: vec![],
            kind: LeafKind::Whole,
            dtype: "float32".into(),
            shape: vec![],
            totals: [4, 0, 0],
        };
        let note = Leaf {
            key: "n".into(),
            path: vec![],
            kind: LeafKind::Bytes,
            dtype: String::new(),
            shape: vec![],
            totals: [9, 0, 0],
        };
        // w: 3 rows over 2 ranks -> 2 + 1 rows: rank 1 is lighter, so s goes there, then n to rank 1 again (60 + 4 < 100)
        let (items, sizes) =
            place(&[step.clone(), sharded("w", &[3], [100, 60, 10]), note], 2).unwrap();
        let got: Vec<_> = items.iter().map(|i| (i.leaf, i.rank, i.offset)).collect();
        // s is first in key order, so first in rank 1's file although placed after the shards
        assert_eq!(got, vec![(0, 1, 0), (1, 0, 0), (1, 1, 4), (2, 1, 64)]);
        assert_eq!(sizes, vec![100, 73]);
    }

    #[test]
    fn pickle_ints_and_memo_match_pythons() {
        let mut p = Pickler::new(Out::Bytes(Vec::new()));
        p.int(5);
        p.int(-(1 << 31));
        p.int(1 << 31);
        p.int(-(1 << 31) - 1);
        let Out::Bytes(out) = &p.out else {
            unreachable!()
        };
        assert_eq!(&out[2..7], b"J\x05\x00\x00\x00");
        assert_eq!(&out[7..12], b"J\x00\x00\x00\x80");
        // Python: (2**31).to_bytes(5, "little", signed=True)
        assert_eq!(&out[12..19], b"\x8a\x05\x00\x00\x00\x80\x00");
        assert_eq!(&out[19..26], b"\x8a\x05\xff\xff\xff\x7f\xff");
        let mut p = Pickler::new(Out::Bytes(Vec::new()));
        for i in 0..300 {
            p.str(&format!("s{i}"));
        }
        let Out::Bytes(out) = &p.out else {
            unreachable!()
        };
        let at = out.len();
        p.str("s0");
        p.str("s299");
        let Out::Bytes(out) = &p.out else {
            unreachable!()
        };
        assert_eq!(&out[at..], b"h\x00j\x2b\x01\x00\x00");
    }

    #[test]
    fn what_a_pickle_int_cannot_hold_is_refused() {
        assert!(place(&[sharded("w", &[u64::MAX], [1, 1, 1])], 1).is_err());
        assert!(place(&[sharded("w", &[1], [1 << 63, 0, 0])], 1).is_err());
    }

    #[test]
    fn metadata_len_is_the_length_of_the_metadata() {
        let leaves = vec![
            sharded("w", &[5, 3], [100, 60, 10]),
            sharded("v", &[300], [7, 7, 7]),
        ];
        let (items, _) = place(&leaves, 4).unwrap();
        let bytes = metadata(&leaves, &items, true, "id").unwrap();
        assert_eq!(
            metadata_len(&leaves, &items, true, "id").unwrap(),
            bytes.len()
        );
        assert_eq!(bytes.last(), Some(&b'.'));
    }

    #[test]
    fn sizes_that_overflow_are_refused() {
        let leaves = vec![
            sharded("a", &[1], [u64::MAX, 0, 0]),
            sharded("b", &[1], [1, 0, 0]),
        ];
        assert!(place(&leaves, 1).is_err());
        assert!(place(&leaves, 0).is_err());
    }
}

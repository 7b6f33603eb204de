"""Cases in zip files: DeepSpeed ZeRO rank files, torch.save archives, hand-written (crafted) archives."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from . import picklekit as pk
from . import zipkit
from .corpus import PWNED, _crafted_pickle, add, code_pickle, flip, seed_of, symlink_out, truncate

# ---- zip files (ZeRO rank files, torch.save, crafted) -------------------------

ZIP_CUTS = ("datapkl-mid", "lh-first-data", "data-mid", "lh-last-data", "central", "central-mid", "zip64-eocd", "eocd", "last-byte")


def zip_cut(label: str, layout: zipkit.Layout) -> int:
    data = layout.data_entries()
    big = max(data, key=lambda e: e.size)
    return {
        "datapkl-mid": layout.entry("data.pkl").data + layout.entry("data.pkl").size // 2,
        "lh-first-data": data[0].header,
        "data-mid": big.data + big.size // 2,
        "lh-last-data": data[-1].header,
        "central": layout.central,
        "central-mid": (layout.central + layout.eocd) // 2,
        "zip64-eocd": layout.zip64_eocd if layout.zip64_eocd is not None else layout.eocd - 20,
        "eocd": layout.eocd,
        "last-byte": layout.size - 1,
    }[label]


def add_zip_cases(prefix: str, base: str, rel: str, cuts: tuple[str, ...] = ZIP_CUTS, flips: int = 3, structure_flips: bool = True) -> None:
    """Truncations at each boundary and flips of one zip file at ``rel`` inside the base."""
    def target(src: Path) -> Path:
        return src / rel

    for label in cuts:
        def cut(src: Path, work: Path, label: str = label) -> Path:
            f = target(src)
            truncate(f, zip_cut(label, zipkit.layout(f)))
            return src
        add(f"{prefix}/truncate-{label}", base, "truncate", cut, inspect_must_fail=True)

    for i in range(flips):
        def flip_pkl(src: Path, work: Path, i: int = i, name: str = f"{prefix}/flip-pkl-{i}") -> Path:
            f = target(src)
            e = zipkit.layout(f).entry("data.pkl")
            r = seed_of(name)
            flip(f, e.data + r.randrange(e.size), r.randrange(8))
            return src
        add(f"{prefix}/flip-pkl-{i}", base, "flip-meta", flip_pkl)

        def flip_data(src: Path, work: Path, i: int = i, name: str = f"{prefix}/flip-data-{i}") -> Path:
            f = target(src)
            r = seed_of(name)
            data = zipkit.layout(f).data_entries()
            e = max(data, key=lambda e: e.size) if i == 0 else r.choice(data)
            flip(f, e.data + r.randrange(e.size), r.randrange(8))
            return src
        add(f"{prefix}/flip-data-{i}", base, "flip-data", flip_data)

    if structure_flips:
        def flip_cd_offset(src: Path, work: Path) -> Path:
            f = target(src)
            lay = zipkit.layout(f)
            # bit 3 of a central record's local-header offset (byte 42) for the first data entry
            raw = f.read_bytes()
            name = zipkit.layout(f).data_entries()[0].name.encode()
            rec = raw.find(b"PK\x01\x02" , lay.central)
            while rec >= 0 and raw[rec + 46: rec + 46 + len(name)] != name:
                rec = raw.find(b"PK\x01\x02", rec + 4)
            flip(f, rec + 42, 3)
            return src
        add(f"{prefix}/flip-central-offset", base, "flip-meta", flip_cd_offset)

        def flip_lh_name(src: Path, work: Path) -> Path:
            f = target(src)
            e = zipkit.layout(f).data_entries()[-1]
            flip(f, e.header + 30 + len(e.name) - 1, 1)  # last char of the name in the local header
            return src
        add(f"{prefix}/flip-local-name", base, "flip-meta", flip_lh_name)

        def flip_eocd(src: Path, work: Path) -> Path:
            f = target(src)
            flip(f, zipkit.layout(f).eocd + 10, 0)  # total number of entries
            return src
        add(f"{prefix}/flip-eocd-count", base, "flip-meta", flip_eocd)

    def empty(src: Path, work: Path) -> Path:
        truncate(target(src), 0)
        return src
    add(f"{prefix}/empty-file", base, "empty", empty, inspect_must_fail=True)


def rewrite_pickle(src_file: Path, edit: Callable[[bytes], bytes]) -> None:
    """Rewrite the data.pkl of a torch.save file through ``edit`` (the zip is rebuilt, CRCs fresh)."""
    import zipfile

    with zipfile.ZipFile(src_file) as z:
        name = next(n for n in z.namelist() if n.endswith("data.pkl"))
        data = z.read(name)
    zipkit.rebuild(src_file, src_file, {"data.pkl": edit(data)})


def add_pickle_size_cases(prefix: str, base: str, rel: str) -> None:
    """Declared sizes that do not fit: storage numel, storage offset."""
    def numel_huge(src: Path, work: Path) -> Path:
        rewrite_pickle(src / rel, lambda d: pk.replace_int_after(d, "cpu", 2**40))
        return src
    add(f"{prefix}/oversize-storage-numel", base, "oversize", numel_huge, must_fail=True)

    def numel_small(src: Path, work: Path) -> Path:
        rewrite_pickle(src / rel, lambda d: pk.replace_int_after(d, "cpu", 1))
        return src
    add(f"{prefix}/oversize-view-past-storage", base, "oversize", numel_small, must_fail=True)

    def offset(value: int) -> Callable[[Path, Path], Path]:
        def edit(src: Path, work: Path) -> Path:
            rewrite_pickle(src / rel, lambda d: _after_persid(d, value))
            return src
        return edit
    add(f"{prefix}/oversize-storage-offset", base, "oversize", offset(2**40), must_fail=True)
    add(f"{prefix}/negative-storage-offset", base, "oversize", offset(-64), must_fail=True)


def _after_persid(data: bytes, value: int) -> bytes:
    """Every storage_offset (the int right after BINPERSID) becomes ``value``."""
    state = {"armed": False}

    def edit(name: str, arg: object, pushed: str | None) -> bytes | None:
        if name == "BINPERSID":
            state["armed"] = True
            return None
        if state["armed"]:
            state["armed"] = False
            if name in pk._INT_OPS:
                return pk._int(value)
        return None

    return pk.rewrite(data, edit)


# ---- DeepSpeed ZeRO ---------------------------------------------------------------

OPT1 = "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
OPT0 = "global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
MS3 = "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt"
MS12 = "global_step3/mp_rank_00_model_states.pt"

add_zip_cases("zero3", "zero3", OPT1)
add_zip_cases("zero3/model-states", "zero3", MS3, cuts=("datapkl-mid", "lh-first-data", "central", "eocd"), flips=2, structure_flips=False)
for _stage, _ms in (("zero1", MS12), ("zero2", MS12)):
    add_zip_cases(_stage, _stage, OPT0, cuts=("lh-first-data", "data-mid", "central", "eocd"), flips=2, structure_flips=False)
    add_zip_cases(f"{_stage}/model-states", _stage, _ms, cuts=("datapkl-mid", "eocd"), flips=1, structure_flips=False)
add_pickle_size_cases("zero3", "zero3", OPT1)


def _latest(text: str | Callable[[Path], str], copy_tag: bool = True) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        if copy_tag:
            shutil.copytree(src / "global_step3", work / "outside" / "global_step3")
        (src / "latest").write_text(text(work) if callable(text) else text)
        return src
    return make


add("zero3/path-latest-dotdot", "zero3", "path", _latest("../outside/global_step3"), must_fail=True, inspect_must_fail=True)
add("zero3/path-latest-absolute", "zero3", "path", _latest(lambda w: str(w / "outside" / "global_step3")), must_fail=True, inspect_must_fail=True)
add("zero3/path-latest-etc", "zero3", "path", _latest("/etc", copy_tag=False), must_fail=True, inspect_must_fail=True)
add("zero3/latest-empty", "zero3", "empty", _latest("", copy_tag=False), must_fail=True, inspect_must_fail=True)
add("zero3/latest-missing-tag", "zero3", "semantic", _latest("global_step999", copy_tag=False), must_fail=True, inspect_must_fail=True)
add("zero3/latest-binary", "zero3", "semantic", _latest("\x00\xff\xfe", copy_tag=False), must_fail=True, inspect_must_fail=True)
add("zero3/path-symlink-tag-dir", "zero3", "path", lambda s, w: (symlink_out(s / "global_step3", w), s)[1], must_fail=True, inspect_must_fail=True)
add("zero3/path-symlink-rank-file", "zero3", "path", lambda s, w: (symlink_out(s / OPT1, w), s)[1], must_fail=True, inspect_must_fail=True)
add("zero3/path-symlink-model-states", "zero3", "path", lambda s, w: (symlink_out(s / MS3, w), s)[1], must_fail=True, inspect_must_fail=True)


def _zero_code(src: Path, work: Path) -> Path:
    rewrite_pickle(src / OPT1, lambda d: code_pickle(work))
    return src


def _zero_code_ms(src: Path, work: Path) -> Path:
    rewrite_pickle(src / MS3, lambda d: code_pickle(work))
    return src


add("zero3/code-os-system-optim", "zero3", "code", _zero_code, must_fail=True, expect="UnsafeCheckpointError")
add("zero3/code-os-system-model-states", "zero3", "code", _zero_code_ms, must_fail=True, expect="UnsafeCheckpointError", inspect_must_fail=True)
add("zero3/missing-rank-file", "zero3", "semantic", lambda s, w: ((s / OPT1).unlink(), s)[1], must_fail=True, inspect_must_fail=True,
    expect="IncompleteCheckpointError")

# ---- torch.save -----------------------------------------------------------------

add_zip_cases("torch_save", "torch_save", "model.pt", flips=3)
add_pickle_size_cases("torch_save", "torch_save", "model.pt")


def _ts_code(command: str | None = None, glob: tuple[str, str] | None = None) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        if glob:
            payload = pk.dumps(pk.Reduce(pk.Global(*glob), (f"open('{work / 'outside' / PWNED}', 'w')",)))
        else:
            payload = code_pickle(work)
        rewrite_pickle(src / "model.pt", lambda d: payload)
        return src / "model.pt"
    return make


add("torch_save/code-os-system", "torch_save", "code", _ts_code(), must_fail=True, expect="UnsafeCheckpointError", inspect_must_fail=True)
add("torch_save/code-builtins-eval", "torch_save", "code", _ts_code(glob=("builtins", "eval")), must_fail=True, expect="UnsafeCheckpointError",
    inspect_must_fail=True)
add("torch_save/code-builtins-exec", "torch_save", "code", _ts_code(glob=("builtins", "exec")), must_fail=True, expect="UnsafeCheckpointError",
    inspect_must_fail=True)


def _ts_nested_code(src: Path, work: Path) -> Path:
    # the call hidden inside an allowed one: OrderedDict(os.system(...))
    payload = pk.dumps({"model": pk.Reduce(pk.Global("collections", "OrderedDict"), (pk.code_reduce(f"touch {work / 'outside' / PWNED}"),))})
    rewrite_pickle(src / "model.pt", lambda d: payload)
    return src / "model.pt"


add("torch_save/code-nested-in-ordereddict", "torch_save", "code", _ts_nested_code, must_fail=True, expect="UnsafeCheckpointError",
    inspect_must_fail=True)

# crafted: one field of tensor "w" (4x4 float32 over a 16-element storage) at a time
_CRAFT = {
    "stride-past-storage": {"stride": (100, 1)},
    "stride-negative": {"stride": (-4, 1)},
    "stride-huge": {"stride": (2**62, 1)},
    "offset-past-storage": {"offset": 1000},
    "offset-negative": {"offset": -8},
    "offset-overlaps-end": {"offset": 1},
    "size-negative": {"size": (-1, 4)},
    "size-overflow": {"size": (2**62, 2**62), "stride": (1, 1)},
    "size-too-big": {"size": (8, 4)},
    "numel-larger-than-entry": {"numel": 64},
    "storage-key-missing": {"key": "9"},
    "storage-class-unknown": {"storage": "QInt8Storage"},
}
for _label, _fields in _CRAFT.items():
    def _craft(src: Path, work: Path, fields: dict[str, object] = _fields) -> Path:
        rewrite_pickle(src / "model.pt", lambda d: _crafted_pickle(**fields))
        return src / "model.pt"
    add(f"crafted/{_label}", "crafted", "oversize", _craft, must_fail=True)


def _craft_raw(payload: Callable[[Path], bytes]) -> Callable[[Path, Path], Path]:
    def make(src: Path, work: Path) -> Path:
        rewrite_pickle(src / "model.pt", lambda d: payload(work))
        return src / "model.pt"
    return make


add("crafted/billion-laughs", "crafted", "bomb", _craft_raw(lambda w: pk.billion_laughs(9, 10)), must_fail=True, inspect_must_fail=True)
add("crafted/deep-nesting", "crafted", "bomb", _craft_raw(lambda w: pk.deep_nesting(200_000)), must_fail=True, inspect_must_fail=True)
add("crafted/persid-garbage", "crafted", "oversize",
    _craft_raw(lambda w: pk.dumps({"w": pk.Reduce(pk.Global("torch._utils", "_rebuild_tensor_v2"),
                                                   (pk.PersId(("storage", 5, None, 7, "x")), 0, (2,), (1,), False, pk.Reduce(pk.Global("collections", "OrderedDict"), ())))})),
    must_fail=True, inspect_must_fail=True)
add("crafted/not-a-pickle", "crafted", "flip-meta", _craft_raw(lambda w: b"\x80\x02this is not a pickle"), must_fail=True, inspect_must_fail=True)
add("crafted/empty-pickle", "crafted", "empty", _craft_raw(lambda w: b""), must_fail=True, inspect_must_fail=True)


def _craft_compressed(src: Path, work: Path) -> Path:
    import zipfile

    f = src / "model.pt"
    with zipfile.ZipFile(f) as z:
        items = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(f, "w") as z:
        for n, d in items:
            z.writestr(n, d, compress_type=zipfile.ZIP_DEFLATED if "/data/" in n else zipfile.ZIP_STORED)
    return f


add("crafted/deflated-storage", "crafted", "semantic", _craft_compressed, must_fail=True, inspect_must_fail=False)

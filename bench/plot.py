"""The lead of each benchmark page: a short table and a chart, drawn from the page's own tables.

    python bench/plot.py                # every page under docs/ that has a chart
    python bench/plot.py convert scale  # some of them (names: see PAGES)

Each bench script writes its page (docs/benchmarks*.md) from its results and then calls
``refresh_doc(path)``, so a re-run refreshes the lead and the chart with it. The tables the
scripts write are the record read here (the raw JSON under bench/out/ is not checked in), so
the charts can be redrawn from the published pages alone.

What is written: between the markers ``<!-- lead -->`` and ``<!-- /lead -->``, just after the
page's first paragraph, a table of the page's headline numbers and a link to the chart; and the
chart, docs/img/<name>.png. matplotlib is a bench-only dependency (bench/requirements.txt),
imported only where a chart is drawn; without it the lead table is still written.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs")
IMG = os.path.join(DOCS, "img")
START, END = "<!-- lead -->", "<!-- /lead -->"

Table = list[dict[str, str]]


# ---------------------------------------------------------------- reading the pages


def tables(text: str) -> list[Table]:
    """Every markdown table of a page, each a list of rows keyed by the header's cells."""
    out: list[Table] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1]):
            head = _cells(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(head, _cells(lines[i]))))
                i += 1
            out.append(rows)
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_with(text: str, column: str) -> Table:
    """The first table of the page that has ``column``."""
    for t in tables(text):
        if t and column in t[0]:
            return t
    raise LookupError(f"no table with a column {column!r}")


def num(cell: str) -> float:
    """The first number of a cell: ``2.20 s [1.94–3.01]`` -> 2.2, ``1,151 MiB`` -> 1151, ``+1.5%`` -> 1.5."""
    m = re.search(r"[-+]?\d[\d,]*(?:\.\d+)?", cell.replace("**", ""))
    if not m:
        raise ValueError(f"no number in {cell!r}")
    return float(m.group().replace(",", ""))


def span(cell: str) -> tuple[float, float, float]:
    """Median, min and max of ``2.20 s [1.94–3.01]`` (min = max = median when there is no range)."""
    mid = num(cell)
    m = re.search(r"\[([\d.,]+)\s*[–-]\s*([\d.,]+)", cell)
    return (mid, float(m.group(1).replace(",", "")), float(m.group(2).replace(",", ""))) if m else (mid, mid, mid)


def md_table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows])


# ---------------------------------------------------------------- one function per page


@dataclass
class Lead:
    """What goes at the top of a page: a table (markdown) and a chart drawn by ``draw(path)``."""

    table: str
    caption: str
    draw: Callable[[str], None]


FORMATS = ["safetensors", "torch_save", "dcp", "native", "zero"]


def _cmd(fmt: str) -> str:
    return f"ravex convert --to {fmt}" + (" --zero-stage 3" if fmt == "zero" else "")


def lead_convert(text: str) -> Lead:
    rows = table_with(text, "paired: ÷ floor beside it")
    inputs = list(dict.fromkeys(r["input"] for r in rows))
    wall = {(r["input"], r["command"]): span(r["wall: median [min–max]"]) for r in rows}
    refs = {i: [r["command"] for r in rows if r["input"] == i and r["ref / ravex"]] for i in inputs}
    body = []
    for fmt in FORMATS:
        for ns in ("", " --no-sync"):
            body.append([f"`{_cmd(fmt)}{ns}`"] + [f"{wall[(i, _cmd(fmt) + ns)][0]:.2f} s" for i in inputs])
    for floor, label in (("cp -r", "`cp -r`"), ("cp -r && sync -f (durable)", "`cp -r && sync -f` (durable)")):
        body.append([label] + [f"{wall[(i, floor)][0]:.2f} s" for i in inputs])
    for ref in dict.fromkeys(r for i in inputs for r in refs[i]):
        body.append([f"reference: `{ref}`"] + [f"{wall[(i, ref)][0]:.2f} s" if (i, ref) in wall else "" for i in inputs])
    table = md_table(["median wall time"] + inputs, body)

    def draw(path: str) -> None:
        plt = _plt()
        fig, axes = plt.subplots(2, 2, figsize=(10, 6.4), sharey="row")
        for ax, i in zip(axes.flat, inputs):
            xs = range(len(FORMATS))
            for off, ns, colour, label in ((-0.2, "", "#1f77b4", "ravex (durable)"), (0.2, " --no-sync", "#9ecae1", "ravex --no-sync")):
                v = [wall[(i, _cmd(f) + ns)] for f in FORMATS]
                ax.bar([x + off for x in xs], [m for m, _, _ in v], 0.4, color=colour, label=label,
                       yerr=[[m - lo for m, lo, _ in v], [hi - m for m, _, hi in v]], capsize=2, ecolor="#555")
            for n, r in enumerate(refs[i]):
                ax.bar(len(FORMATS) - 0.2 + n * 0.4, wall[(i, r)][0], 0.4, color="#d62728" if n == 0 else "#ff9896",
                       label="reference tool" if n == 0 else None)
            ax.axhline(wall[(i, "cp -r")][0], ls="--", color="#333", lw=1, label="cp -r")
            ax.axhline(wall[(i, "cp -r && sync -f (durable)")][0], ls="-", color="#2ca02c", lw=1.2, label="cp -r && sync -f")
            ax.set_xticks(list(xs) + [len(FORMATS) - 0.2 + 0.2 * (len(refs[i]) - 1)])
            ax.set_xticklabels(FORMATS + [refs[i][0].split(" ")[0].replace(".py", "").replace("_to_", "_to_\n")], fontsize=8)
            ax.set_title(i, fontsize=10)
            ax.set_ylabel("seconds (median, min–max)", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        axes.flat[0].legend(fontsize=7, loc="upper left")
        fig.suptitle("ravex convert: wall time by output format, against cp and the reference tools", fontsize=11)
        _save(fig, path)

    return Lead(table, "Median wall time of each conversion (lower is better; bars: min–max of the timed runs). "
                "zero_to_fp32 writes what `--to safetensors` writes, dcp_to_torch_save what `--to torch_save` writes; "
                "neither waits for the disk.", draw)


def lead_reshard(text: str) -> Lead:
    rows = table_with(text, "÷ ravex")
    inputs = list(dict.fromkeys(r["input"] for r in rows))
    cmds = list(dict.fromkeys(r["command"] for r in rows))
    wall = {(r["input"], r["command"]): span(r["wall: median [min–max]"]) for r in rows}
    table = md_table(["median wall time"] + inputs,
                     [[f"`{c}`"] + [f"{wall[(i, c)][0]:.2f} s" if (i, c) in wall else "" for i in inputs] for c in cmds])

    def draw(path: str) -> None:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(9, 4.2))
        labels = [f"{c}\n({i.split(',')[0]})" for i in inputs for c in cmds if (i, c) in wall]
        vals = [wall[(i, c)] for i in inputs for c in cmds if (i, c) in wall]
        colours = ["#1f77b4" if c.startswith("ravex") else "#d62728" if c.startswith("DCP") else "#7f7f7f"
                   for i in inputs for c in cmds if (i, c) in wall]
        y = list(range(len(vals)))[::-1]
        ax.barh(y, [m for m, _, _ in vals], color=colours,
                xerr=[[m - lo for m, lo, _ in vals], [hi - m for m, _, hi in vals]], capsize=2, ecolor="#555")
        for yy, (m, _, hi) in zip(y, vals):
            ax.text(hi * 1.04, yy, f"{m:.2f} s", va="center", fontsize=7)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("seconds, log scale (median, min–max)", fontsize=8)
        ax.set_xlim(right=max(hi for _, _, hi in vals) * 1.6)
        ax.set_title("Reshard 2 → 3 ranks, 2.5 GB: Ravex (blue), copies (grey), DCP load + save (red)", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        _save(fig, path)

    return Lead(table, "Median wall time of a reshard from world size 2 to 3 (lower is better).", draw)


def lead_runtime(text: str) -> Lead:
    thr = table_with(text, "loop time per run (s)")
    blk = table_with(text, "samples (s)")
    slow = re.search(r"Slowdown with checkpoints: \*\*([^*]+)\*\*", text)
    ratio = re.search(r"Ratio: \*\*([^*]+)\*\*", text)
    table = md_table(["what", "without Ravex", "with Ravex", "result"], [
        ["loop time, 40 steps (median)", thr[0]["median"], thr[1]["median"], f"{slow.group(1) if slow else '?'} with a checkpoint every 10 steps"],
        ["training thread blocked per checkpoint", f"{blk[1]['median']} (a plain `clone()`)", blk[0]["median"],
         f"{ratio.group(1) if ratio else '?'} of a `clone()`"],
        ["peak RssAnon", thr[0]["peak RssAnon"], thr[1]["peak RssAnon"], ""],
    ])

    def draw(path: str) -> None:
        plt = _plt()
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
        loops = [[float(x) for x in r["loop time per run (s)"].split(",")] for r in thr]
        a.boxplot(loops, widths=0.5)
        a.set_xticks([1, 2], ["Ravex off", "checkpoint every 10"], fontsize=8)
        a.set_ylabel("loop time, 40 steps (s)", fontsize=8)
        a.set_title(f"Loop time: {slow.group(1) if slow else ''}", fontsize=10)
        a.grid(axis="y", alpha=0.3)
        samples = [[float(x) for x in r["samples (s)"].split(",")] for r in blk]
        b.bar([0, 1], [num(blk[0]["median"]), num(blk[1]["median"])], color=["#1f77b4", "#7f7f7f"], width=0.5)
        for k, s in enumerate(samples):
            b.plot([k] * len(s), s, "k.", ms=4)
        b.set_xticks([0, 1], ["Ravex collect", "plain clone()"], fontsize=8)
        b.set_ylabel("seconds blocked per checkpoint", fontsize=8)
        b.set_title(f"Training thread blocked: {ratio.group(1) if ratio else ''}", fontsize=10)
        b.grid(axis="y", alpha=0.3)
        fig.suptitle("@ravex.train_loop, 100.7 M parameters + AdamW, 1 CPU thread", fontsize=11)
        _save(fig, path)

    return Lead(table, "Checkpointing cost inside a CPU training loop (medians of 3 runs; dots: each checkpoint).", draw)


def lead_runtime_dist(text: str) -> Lead:
    blk = table_with(text, "`Runtime.collect`, all in-loop")
    mem = table_with(text, "job peak RssAnon (all processes)")
    loop = table_with(text, "slowdown (medians)")
    modes = list(dict.fromkeys(r["mode"] for r in blk))
    b0 = {r["mode"]: r["`Runtime.collect`, all in-loop"] for r in blk if r["rank"] == "0"}
    m0 = {r["run"]: r["rank 0: before 1st checkpoint / end"].split("/")[1].strip() for r in mem}
    sl = {r["mode"]: r["slowdown (medians)"].replace("**", "") for r in loop}
    table = md_table(["mode", "rank 0 blocked per checkpoint", "loop slowdown, 40 steps", "rank 0 peak memory"],
                     [[m, b0[m].split(" [")[0], sl.get(m, ""), m0.get(m, "")] for m in modes])

    def draw(path: str) -> None:
        plt = _plt()
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
        for r in blk:
            k = modes.index(r["mode"]) + (-0.2 if r["rank"] == "0" else 0.2)
            m, lo, hi = span(r["`Runtime.collect`, all in-loop"])
            a.bar(k, m, 0.4, color="#1f77b4" if r["rank"] == "0" else "#9ecae1", yerr=[[m - lo], [hi - m]], capsize=2,
                  ecolor="#555", label=f"rank {r['rank']}" if r["mode"] == modes[0] else None)
        a.set_xticks(range(len(modes)), modes, fontsize=8)
        a.set_ylabel("seconds blocked per checkpoint", fontsize=8)
        a.set_title("Training thread blocked (median, min–max)", fontsize=10)
        a.legend(fontsize=7)
        a.grid(axis="y", alpha=0.3)
        vals = [num(sl[m]) for m in modes if m in sl]
        b.bar(range(len(vals)), vals, 0.5, color=["#d62728" if v > 5 else "#2ca02c" for v in vals])
        b.axhline(5, ls="--", color="#333", lw=1, label="5% target")
        b.axhline(0, color="#333", lw=0.5)
        b.set_xticks(range(len(vals)), [m for m in modes if m in sl], fontsize=8)
        b.set_ylabel("loop time vs Ravex off (%)", fontsize=8)
        b.set_title("Loop slowdown, checkpoint every 10 steps", fontsize=10)
        b.legend(fontsize=7)
        b.grid(axis="y", alpha=0.3)
        fig.suptitle("@ravex.train_loop under torchrun, 2 ranks, 100.7 M parameters + AdamW, CPU", fontsize=11)
        _save(fig, path)

    return Lead(table, "Cost of checkpointing a 2-rank job, by how the state is sharded (lower is better).", draw)


def lead_foreign_resume(text: str) -> Lead:
    t = table_with(text, "÷ DeepSpeed's load")
    mem = table_with(text, "peak RSS during the load")
    ds = next(r for r in t if r["what"].startswith("DeepSpeed"))
    rx = next(r for r in t if "Ravex's cost" in r["what"])
    cp = next(r for r in t if r["what"].startswith("`cp -r`"))
    peak = {(r["run"], r["rank"]): r["peak RSS during the load"] for r in mem}
    table = md_table(["what", "DeepSpeed `load_checkpoint`", "Ravex into FSDP2", "Ravex ÷ DeepSpeed"], [
        ["resume time (slowest rank)", ds["time"].split(" [")[0], rx["time"].replace("**", ""), rx["÷ DeepSpeed's load"].replace("**", "")],
        ["peak memory during the load, rank 0", peak[("DeepSpeed", "0")], peak[("Ravex", "0")],
         f"{num(peak[('Ravex', '0')]) / num(peak[('DeepSpeed', '0')]):.2f}x"],
    ])

    def draw(path: str) -> None:
        plt = _plt()
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
        a.bar([0, 1, 2], [num(ds["time"]), num(rx["time"]), num(cp["time"])], 0.5, color=["#d62728", "#1f77b4", "#7f7f7f"])
        a.set_xticks([0, 1, 2], ["DeepSpeed load", "Ravex start + restore", "cp -r (context)"], fontsize=8)
        a.set_ylabel("seconds (median of 3)", fontsize=8)
        a.set_title("Resume time, slowest rank", fontsize=10)
        a.grid(axis="y", alpha=0.3)
        runs = ["DeepSpeed", "Ravex"]
        b.bar([0, 1], [num(peak[(r, "0")]) for r in runs], 0.5, color=["#d62728", "#1f77b4"])
        b.set_xticks([0, 1], runs, fontsize=8)
        b.set_ylabel("MiB", fontsize=8)
        b.set_title("Peak memory during the load, rank 0", fontsize=10)
        b.grid(axis="y", alpha=0.3)
        fig.suptitle("A DeepSpeed ZeRO-3 checkpoint (1.26 GB) resumed at 2 ranks: DeepSpeed itself vs FSDP2 through Ravex", fontsize=10)
        _save(fig, path)

    return Lead(table, "Resuming one checkpoint two ways (lower is better).", draw)


def lead_scale(text: str) -> Lead:
    rows = table_with(text, "plan time: median [min–max]")
    models = list(dict.fromkeys(r["model"] for r in rows))
    cell = {(r["model"], r["target"]): r for r in rows}
    targets = list(dict.fromkeys(r["target"] for r in rows))
    table = md_table(["model"] + [f"{t}: plan time / RSS" for t in targets],
                     [[m] + [f"{cell[(m, t)]['plan time: median [min–max]'].split(' [')[0]} / {cell[(m, t)]['plan RSS']}" for t in targets]
                      for m in models])

    def draw(path: str) -> None:
        plt = _plt()
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
        xs = range(len(models))
        for t, mark in zip(targets, "osd^"):
            a.plot(xs, [num(cell[(m, t)]["plan time: median [min–max]"]) for m in models], marker=mark, label=t)
            b.plot(xs, [num(cell[(m, t)]["plan RSS"]) for m in models], marker=mark, label=t)
        a.axhline(1.0, ls="--", color="#333", lw=1, label="1 s target")
        b.axhline(100, ls="--", color="#333", lw=1, label="100 MB target")
        for ax, yl, title in ((a, "plan time (s, median of 3)", "Plan time"), (b, "plan RSS (MB)", "Plan memory")):
            ax.set_xticks(list(xs), [m.replace("Llama-3-shaped ", "").replace("Llama-3 ", "") for m in models], fontsize=8)
            ax.set_xlabel("model (Llama-3 shapes; ZeRO-3 at 16 to 192 ranks)", fontsize=8)
            ax.set_ylabel(yl, fontsize=8)
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle("Planning a ZeRO-3 checkpoint's conversion, Llama-3 8B to 405B (synthetic metadata)", fontsize=11)
        _save(fig, path)

    return Lead(table, "Time and memory to plan a conversion, by model size and target (the targets: 1 s, 100 MB).", draw)


def lead_throughput(text: str) -> Lead:
    rows = table_with(text, "÷ its cp floor")
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    cmds = list(dict.fromkeys(r["command"] for r in rows))
    rate = {(r["size"], r["command"]): num(r["rate"]) for r in rows}
    table = md_table(["rate (input bytes / wall)"] + sizes, [[f"`{c}`"] + [f"{rate[(s, c)]:.2f} GB/s" for s in sizes] for c in cmds])

    def draw(path: str) -> None:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(7, 3.8))
        xs = [num(s) for s in sizes]
        for c, style in zip(cmds, ["o-", "s-", "o--", "s--"]):
            ax.plot(xs, [rate[(s, c)] for s in sizes], style, label=c, color="#1f77b4" if c.startswith("ravex") else "#7f7f7f")
        ax.set_xlabel("input size (GB)", fontsize=8)
        ax.set_ylabel("GB/s (median)", fontsize=8)
        ax.set_title("One torch_save written from a safetensors file: rate against input size", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        _save(fig, path)

    return Lead(table, "Copy rate against input size (higher is better); cp falls by the same factor.", draw)


PAGES: dict[str, tuple[str, Callable[[str], Lead]]] = {
    "convert": ("benchmarks.md", lead_convert),
    "reshard": ("benchmarks-reshard.md", lead_reshard),
    "runtime": ("benchmarks-runtime.md", lead_runtime),
    "runtime-dist": ("benchmarks-runtime-dist.md", lead_runtime_dist),
    "foreign-resume": ("benchmarks-foreign-resume.md", lead_foreign_resume),
    "scale": ("benchmarks-scale.md", lead_scale),
    "throughput": ("benchmarks-throughput.md", lead_throughput),
}


# ---------------------------------------------------------------- writing


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib  # bench-only dependency (bench/requirements.txt)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "figure.dpi": 100, "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _save(fig, path: str) -> None:  # type: ignore[no-untyped-def]
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})  # no version stamp: same numbers, same bytes
    import matplotlib.pyplot as plt

    plt.close(fig)


def with_lead(text: str, name: str, lead: Lead) -> str:
    """The page with its lead block (table, chart) replaced, or put after the first paragraph below the title."""
    block = "\n".join([START, "", "## Summary", "", lead.table, "", f"![{name} chart](img/{name}.png)", "",
                       f"*{lead.caption} Drawn by `bench/plot.py` from the tables below.*", "", END])
    if START in text and END in text:
        a, b = text.index(START), text.index(END) + len(END)
        return text[:a] + block + text[b:]
    paras = text.split("\n\n")
    return "\n\n".join(paras[:2] + [block] + paras[2:])


def refresh(name: str, chart: bool = True) -> str:
    """Rewrite the lead of one page from its tables and draw its chart; returns the chart's path."""
    page, make = PAGES[name]
    path = os.path.join(DOCS, page)
    with open(path) as f:
        text = f.read()
    lead = make(text)
    new = with_lead(text, name, lead)
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    png = os.path.join(IMG, f"{name}.png")
    if chart:
        try:
            lead.draw(png)
        except ImportError:
            print(f"plot.py: matplotlib is not installed (pip install -r bench/requirements.txt); {png} not redrawn", file=sys.stderr)
    return png


def refresh_doc(doc: str | None) -> None:
    """Called by the bench scripts after writing ``doc``: refresh its lead and chart when it has one."""
    if not doc:
        return
    for name, (page, _) in PAGES.items():
        if os.path.abspath(doc) == os.path.join(DOCS, page):
            try:
                refresh(name)
            except (LookupError, ValueError, KeyError, AttributeError) as e:  # a page whose tables changed shape
                print(f"plot.py: {doc}: lead and chart not refreshed ({type(e).__name__}: {e}); "
                      f"the page itself is written; fix lead_{name.replace('-', '_')} in bench/plot.py", file=sys.stderr)


def main(argv: list[str]) -> int:
    names = argv or list(PAGES)
    unknown = [n for n in names if n not in PAGES]
    if unknown:
        print(f"plot.py: unknown page {', '.join(unknown)}; known: {', '.join(PAGES)}", file=sys.stderr)
        return 2
    for n in names:
        png = refresh(n)
        print(f"{os.path.relpath(png)}: {os.path.getsize(png) / 1024:.0f} KiB" if os.path.exists(png) else png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

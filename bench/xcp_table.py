"""Cross-rank CP on one GPU (tests/gpu/test_xcp_cuda.c, R ranks simulated): its log into results.md, results.json
and cp_ranks.png. The test prints, per case and split, each output's relative error against the fp64 oracle for
the split run and the unsplit run ("name split/unsplit"), then the T = 4 x 32768 H8 row and the costs on one rank.

    ./build-gpu/tests/test_gpu_xcp > xcp.log
    python3 bench/xcp_table.py xcp.log --out bench/results/cp_ranks --date 2026-12-03 --card "NVIDIA H200" --commit X
"""
import argparse
import json
import os
import re


def parse(path):
    rows, big, cost = [], None, None
    for line in open(path):
        m = re.match(r"(.+) R=(\d+) split (\d+): (.*)", line)
        if m:
            errs = {n: (float(s), float(u)) for n, s, u in re.findall(r"(\w+) ([\d.e+-]+)/([\d.e+-]+)", m.group(4))}
            rows.append({"case": m.group(1), "R": int(m.group(2)), "split": int(m.group(3)), "errors": errs})
        m = re.search(r"o error ([\d.e+-]+) split / ([\d.e+-]+) unsplit .*final state ([\d.e+-]+) / ([\d.e+-]+)", line)
        if m and line.startswith("T 4x32768"):
            big = dict(zip(("o_split", "o_unsplit", "ht_split", "ht_unsplit"), map(float, m.groups())))
        m = re.search(r"plain forward ([\d.]+) ms, folding forward ([\d.]+) ms .* summary ([\d.]+) ms.*all-gather (\d+)",
                      line)
        if m:
            cost = dict(zip(("plain_ms", "fold_ms", "summary_ms"), map(float, m.groups()[:3])))
            cost["allgather_bytes"] = int(m.group(4))
    return rows, big, cost


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--out", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--card", required=True)
    ap.add_argument("--commit", required=True)
    a = ap.parse_args()
    rows, big, cost = parse(a.log)
    os.makedirs(a.out, exist_ok=True)
    meta = {"date": a.date, "card": a.card, "commit": a.commit}
    json.dump({"meta": meta, "splits": rows, "t4x32768": big, "cost": cost}, open(f"{a.out}/results.json", "w"),
              indent=1)
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state", "dA_log", "ddt_bias"]
    md = [f"# Context parallelism across ranks on one GPU (R ranks simulated): libkda's CUDA backend",
          "", f"- Date: {a.date}. Card: one {a.card}. Commit: {a.commit}.",
          "- tests/gpu/test_xcp_cuda.c: one problem cut into R slices of its packed tokens (empty slices, cuts on",
          "  sequence boundaries, a 1-token rank), summaries exchanged by copying, against the unsplit CUDA run;",
          "  each cell is the split run's relative error against the fp64 oracle over the unsplit run's (x).", "",
          "Reproduce:", "", "    ./build-gpu/tests/test_gpu_xcp > xcp.log",
          "    python3 bench/xcp_table.py xcp.log --out DIR --date D --card C --commit X", ""]
    if big and cost:
        over = 100.0 * (cost["fold_ms"] - cost["plain_ms"]) / cost["plain_ms"]
        md += ["## T = 4 x 32768, H8, K = V = 128, bf16, R = 4 (oracle: the CPU backend)", "",
               f"- o: {big['o_split']:.3e} split, {big['o_unsplit']:.3e} unsplit "
               f"({big['o_split'] / big['o_unsplit']:.3f}x); final state {big['ht_split']:.3e} / "
               f"{big['ht_unsplit']:.3e} ({big['ht_split'] / big['ht_unsplit']:.3f}x).",
               f"- One rank of 32768 tokens: plain forward {cost['plain_ms']:.3f} ms, the forward that folds "
               f"{cost['fold_ms']:.3f} ms (+{over:.1f} %), its summary {cost['summary_ms']:.3f} ms "
               f"({100 * cost['summary_ms'] / cost['plain_ms']:.0f} % of the plain forward); the all-gather moves "
               f"{cost['allgather_bytes']:,} bytes (R x HV x K x (K + V) x 4).", ""]
    md += ["## Every split (error ratio split / unsplit)", "",
           "| case | R | split | " + " | ".join(names) + " |", "|---|---:|---:|" + "---:|" * len(names)]
    for r in rows:
        cells = [f"{r['errors'][n][0] / r['errors'][n][1]:.2f}" if n in r["errors"] else "" for n in names]
        md.append(f"| {r['case']} | {r['R']} | {r['split']} | " + " | ".join(cells) + " |")
    open(f"{a.out}/results.md", "w").write("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for n in names:
        ys = [r["errors"][n][0] / r["errors"][n][1] for r in rows if n in r["errors"]]
        ax.plot(range(len(ys)), ys, marker="o", label=n)
    ax.axhline(1.1, color="k", ls="--", lw=0.8)
    ax.set_xticks(range(len(rows)))
    short = lambda c: (c.replace("cuda", "").strip().split() or ["plain"])[0]  # the case's first word
    ax.set_xticklabels([f"{short(r['case'])}\nR={r['R']}" for r in rows], fontsize=7)
    ax.set_ylabel("split error / unsplit error (vs fp64 oracle)")
    ax.set_title(f"Cross-rank CP on one {a.card}, {a.commit}: error of the split run over the unsplit run")
    ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(f"{a.out}/cp_ranks.png", dpi=110)


if __name__ == "__main__":
    main()

"""libkda's gradient errors (a bench/bwd_accuracy.py log) against FLA's rows on the same inputs (other such logs,
earlier runs: FLA 0.6.0 and the cases' seeds do not change), gradient by gradient: the ratio kda / FLA, and the
largest per case-seed and overall (issue 11: every ratio <= 1).

    python3 bench/acc_vs_fla.py NEW.log FLA1.log [FLA2.log ...]

A case without "/seed" in the log (--seeds 1) is seed 0. Rows are "case[/seed] impl e_q e_k e_v e_g e_beta e_h0
e_A_log e_dt_bias"; the last FLA row read for a case-seed counts."""
import sys

GRADS = ("q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias")


def rows(path, impl):
    out = {}
    for line in open(path):
        f = line.split()
        if len(f) == 2 + len(GRADS) and f[1] == impl:
            name = f[0] if "/" in f[0] else f[0] + "/0"
            out[name] = [float(x) for x in f[2:]]
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    kda = rows(sys.argv[1], "kda")
    fla = {}
    for p in sys.argv[2:]:
        fla.update(rows(p, "fla"))
    print(f"{'case':22s} " + " ".join(f"{g:>8s}" for g in GRADS) + "   worst")
    worst_all, missing = 0.0, []
    for name in sorted(kda):
        if name not in fla:
            missing.append(name)
            continue
        r = [a / b for a, b in zip(kda[name], fla[name])]
        i = max(range(len(r)), key=r.__getitem__)
        worst_all = max(worst_all, r[i])
        print(f"{name:22s} " + " ".join(f"{x:8.2f}" for x in r) + f"   {r[i]:.2f} ({GRADS[i]})")
    print(f"largest kda / FLA ratio: {worst_all:.2f} over {len(kda) - len(missing)} case-seeds"
          + (f"; no FLA row for {', '.join(missing)}" if missing else ""))


if __name__ == "__main__":
    main()

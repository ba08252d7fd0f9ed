"""Two emulator runs' gradients (run.sh suite with EMU_DUMP_DIR), case by case: '=' where a gradient's bits are
equal, else ‖b − a‖ / ‖a‖ and how many values differ. The sizes come from each file's name (the harness's args,
joined by '_'; a 'nol2_' prefix for the l2norm-off case) and the harness's sequence lengths per mode.
    python3 dev/bwd_emu/compare.py DIR_A DIR_B
"""
import array
import math
import os
import sys

NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"]
LENS = {0: [70, 0, 20, 129], 1: [1], 2: [64, 65, 127, 0], 3: [100, 100, 100]}  # harness.emu.cu's, by mode


def sizes(name):
    a = [int(float(x)) for x in name.replace("nol2_", "").split("_")]
    K, V = a[0], a[1]
    mode, hqk, hv = (a[5] if len(a) > 5 else 0), (a[6] if len(a) > 6 else 1), (a[7] if len(a) > 7 else 2)
    T, N = sum(LENS[mode]), len(LENS[mode])
    return [T * hqk * K, T * hqk * K, T * hv * V, T * hv * K, T * hv, N * hv * K * V, hv, hv * K]


def load(path):
    x = array.array("f")
    with open(path, "rb") as f:
        x.frombytes(f.read())
    return x


def main(a_dir, b_dir):
    for fn in sorted(os.listdir(a_dir)):
        if not fn.endswith(".bin") or not os.path.exists(os.path.join(b_dir, fn)):
            continue
        n = sizes(fn[:-4])
        x, y = load(os.path.join(a_dir, fn)), load(os.path.join(b_dir, fn))
        if len(x) != sum(n) or len(y) != sum(n):
            print(f"{fn[:-4]:32s} sizes differ from the harness's ({len(x)}, {len(y)}, {sum(n)})")
            continue
        out, o = [], 0
        for name, m in zip(NAMES, n):
            xs, ys = x[o:o + m], y[o:o + m]
            o += m
            if xs.tobytes() == ys.tobytes():
                out.append(f"{name} =")
                continue
            fin = [(p, q) for p, q in zip(xs, ys) if math.isfinite(p) and math.isfinite(q)]
            num, den = sum((q - p) ** 2 for p, q in fin), sum(p * p for p, _ in fin)
            nd = sum(1 for i in range(m) if xs[i:i + 1].tobytes() != ys[i:i + 1].tobytes())
            out.append(f"{name} {math.sqrt(num / den) if den else float('nan'):.1e} ({nd}/{m} differ)")
        print(f"{fn[:-4]:32s} " + "  ".join(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

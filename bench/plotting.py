"""The benchmarks' plots: matplotlib's pyplot on the Agg backend (no display), or None where matplotlib is
missing or broken (plotting is a nicety: the caller skips its PNG; the reason is printed)."""


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print("no plot:", e)
        return None
    return plt

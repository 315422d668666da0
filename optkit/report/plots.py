"""PNG plots for the HTML report: the roofline and the Pareto trade-offs.

Figures are built on ``matplotlib.figure.Figure`` with an Agg canvas (no pyplot: no global
figure registry, no display, safe in a server or CI). Output is byte-stable for the same input
and matplotlib version: matplotlib's default style (a user's matplotlibrc can not change the
picture), the bundled DejaVu Sans font, a fixed size and dpi, and no ``Software`` metadata
(which would carry the version string). Each function returns PNG bytes.
"""

from __future__ import annotations

import io

import matplotlib
import matplotlib.style
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from optkit.report.pareto import X_LABELS, Y_LABELS, frontier
from optkit.report.schema import Report, value_of

DPI = 100
_RC = {"font.family": "DejaVu Sans", "font.size": 9, "axes.titlesize": 10, "svg.hashsalt": "optkit"}
_MARKER = {"decode": "o", "prefill": "s"}


def _figure(w: float = 8.0, h: float = 5.0) -> Figure:
    fig = Figure(figsize=(w, h), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _colors(names: list[str]) -> dict[str, str]:
    cycle = matplotlib.colormaps["tab10"].colors
    return {n: matplotlib.colors.to_hex(cycle[i % len(cycle)]) for i, n in enumerate(names)}


def roofline_png(report: Report) -> bytes:
    """Log-log roofline: the bandwidth slope (GB/s x FLOP/byte), one flat compute roof per
    dtype measured, and each variant's achieved points (circles: decode, squares: prefill),
    labelled by batch or prompt length. Decode at small batch sits on the slope (weight reads
    bound it); long prefills sit near a roof."""
    with matplotlib.style.context("default"), matplotlib.rc_context(_RC):
        fig = _figure()
        ax = fig.add_subplot()
        bw = value_of(report.machine.peak_read_bandwidth)  # GB/s
        roofs = {k: float(value_of(m)) for k, m in sorted(report.machine.peak_matmul.items()) if value_of(m)}
        pts = [(v.name, p) for v in report.variants if v.status == "ok" for p in v.roofline.points]
        xs = [p.intensity_flop_per_byte for _, p in pts]
        ridges = [peak * 1e3 / bw for peak in roofs.values()] if bw else []
        lo = min(xs + ridges + [1.0]) / 4
        hi = max(xs + ridges + [10.0]) * 4
        n = 200
        grid = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
        top = max(list(roofs.values()) + [p.achieved_tflops for _, p in pts] + [bw * hi / 1e3 if bw and not roofs else 0.0] + [1e-6])
        if bw:
            ax.plot(grid, [bw * x / 1e3 for x in grid], color="0.55", ls="--", lw=1,
                    label=f"read bandwidth {bw:.1f} GB/s (slope)")
        for i, (dtype, peak) in enumerate(roofs.items()):
            ys = [min(peak, bw * x / 1e3) if bw else peak for x in grid]
            ax.plot(grid, ys, color="black", lw=1.6 - 0.3 * i, ls=["-", "-.", ":"][i % 3], label=f"{dtype} roof {peak:.3g} TFLOP/s")
        colors = _colors([v.name for v in report.variants])
        seen: set[tuple[str, str]] = set()
        for name, p in pts:
            key = (name, p.phase)
            ax.scatter([p.intensity_flop_per_byte], [max(p.achieved_tflops, 1e-9)], color=colors[name],
                       marker=_MARKER[p.phase], s=36, zorder=3, label=f"{name} {p.phase}" if key not in seen else None)
            seen.add(key)
            short = p.label.replace("decode ", "").replace("prefill ", "")
            ax.annotate(short, (p.intensity_flop_per_byte, max(p.achieved_tflops, 1e-9)), textcoords="offset points",
                        xytext=(4, 3), fontsize=7, color=colors[name])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        low = min([p.achieved_tflops for _, p in pts if p.achieved_tflops > 0] + [top]) / 5
        ax.set_ylim(max(low, top * 1e-6), top * 2)
        ax.set_xlabel("arithmetic intensity, FLOP/byte")
        ax.set_ylabel("achieved TFLOP/s")
        title = "Roofline (circles: decode, labelled by batch; squares: prefill, by prompt tokens)"
        if not bw:
            title += "\npeak bandwidth not measured"
        if not pts:
            ax.text(0.5, 0.5, "no roofline points measured", transform=ax.transAxes, ha="center", va="center")
        ax.set_title(title)
        ax.grid(True, which="both", lw=0.3, color="0.85")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", ncols=2)
        fig.tight_layout()
        return _png(fig)


def pareto_png(report: Report, x: str = "decode_latency") -> bytes:
    """Quality loss against ``x`` ("decode_latency": ms/token at batch 1, or "size": weight
    MB). The frontier is a staircase through the non-dominated variants; the recommended
    variant is ringed, the baseline drawn as a diamond; left-out variants are listed below."""
    res = frontier(report, x)
    with matplotlib.style.context("default"), matplotlib.rc_context(_RC):
        fig = _figure(7.0, 4.8)
        ax = fig.add_subplot()
        colors = _colors([v.name for v in report.variants])
        rec = report.verdict.recommended if report.verdict else None
        if len(res.frontier) >= 1:
            fx = [res.points[n][0] for n in res.frontier]
            fy = [res.points[n][1] for n in res.frontier]
            ax.step(fx, fy, where="post", color="0.4", lw=1.2, zorder=1, label="Pareto frontier")
        for name, (px, py) in res.points.items():
            ax.scatter([px], [py], color=colors[name], marker="D" if name == report.baseline else "o", s=40, zorder=3)
            ax.annotate(name, (px, py), textcoords="offset points", xytext=(5, 4), fontsize=8)
            if name == rec:
                ax.scatter([px], [py], s=260, facecolors="none", edgecolors="crimson", linewidths=2, zorder=4,
                           label=f"recommended: {name}")
        if not res.points:
            ax.text(0.5, 0.5, "no variant has both figures", transform=ax.transAxes, ha="center", va="center")
        ax.set_xlabel(X_LABELS[x])
        ax.set_ylabel(Y_LABELS[res.y])
        ax.set_title(f"Quality loss vs {X_LABELS[x].split(',')[0]} (lower-left is better)")
        ax.grid(True, lw=0.3, color="0.85")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
        if res.excluded:
            fig.text(0.01, 0.01, "left out: " + "; ".join(res.notes), fontsize=7, color="0.3")
        fig.tight_layout(rect=(0, 0.04 if res.excluded else 0, 1, 1))
        return _png(fig)


__all__ = ["DPI", "pareto_png", "roofline_png"]

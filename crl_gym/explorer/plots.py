"""Server-rendered SVG line charts for the over-training page: no plotting script, nothing fetched.

Built with :mod:`xml.etree.ElementTree`, which escapes every text and attribute, so a chart is
well-formed whatever the labels hold. The page shows a chart as an ``<img>`` of a blob URL: an
SVG shown that way cannot run a script even if one got in.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence

WIDTH, HEIGHT = 660, 220
PAD_L, PAD_R, PAD_T, PAD_B = 52, 12, 28, 30
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.2f}"


def line_chart(
    title: str, xs: Sequence[float], series: Mapping[str, Sequence[float | None]]
) -> str:
    """One chart: ``series`` name → y per x (``None``: no value, the line breaks there)."""
    svg = ET.Element(
        "svg",
        xmlns="http://www.w3.org/2000/svg",
        width=str(WIDTH),
        height=str(HEIGHT),
        viewBox=f"0 0 {WIDTH} {HEIGHT}",
        role="img",
    )
    ET.SubElement(svg, "title").text = title
    ET.SubElement(svg, "rect", width=str(WIDTH), height=str(HEIGHT), fill="#ffffff")
    ET.SubElement(
        svg,
        "text",
        x=str(PAD_L),
        y="17",
        attrib={"font-size": "13", "font-family": "sans-serif", "font-weight": "bold"},
    ).text = title
    ys = [float(y) for s in series.values() for y in s if y is not None and math.isfinite(y)]
    if not xs or not ys:
        ET.SubElement(
            svg,
            "text",
            x=str(WIDTH // 2),
            y=str(HEIGHT // 2),
            attrib={
                "text-anchor": "middle",
                "font-size": "12",
                "font-family": "sans-serif",
                "fill": "#666",
            },
        ).text = "no data yet"
        return ET.tostring(svg, encoding="unicode")
    x0, x1 = float(min(xs)), float(max(xs))
    y0, y1 = min(ys + [0.0]), max(ys)
    if y1 == y0:
        y1 = y0 + 1.0
    if x1 == x0:
        x1 = x0 + 1.0

    def px(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * (WIDTH - PAD_L - PAD_R)

    def py(y: float) -> float:
        return HEIGHT - PAD_B - (y - y0) / (y1 - y0) * (HEIGHT - PAD_T - PAD_B)

    axis = {"stroke": "#999", "stroke-width": "1"}
    label = {"font-size": "10", "font-family": "sans-serif", "fill": "#444"}
    ET.SubElement(
        svg,
        "line",
        x1=str(PAD_L),
        y1=str(HEIGHT - PAD_B),
        x2=str(WIDTH - PAD_R),
        y2=str(HEIGHT - PAD_B),
        attrib=axis,
    )
    ET.SubElement(
        svg,
        "line",
        x1=str(PAD_L),
        y1=str(PAD_T),
        x2=str(PAD_L),
        y2=str(HEIGHT - PAD_B),
        attrib=axis,
    )
    for t in _ticks(y0, y1):
        ET.SubElement(
            svg,
            "text",
            x=str(PAD_L - 4),
            y=f"{py(t) + 3:.1f}",
            attrib={**label, "text-anchor": "end"},
        ).text = _fmt(t)
        ET.SubElement(
            svg,
            "line",
            x1=str(PAD_L),
            y1=f"{py(t):.1f}",
            x2=str(WIDTH - PAD_R),
            y2=f"{py(t):.1f}",
            attrib={"stroke": "#eee", "stroke-width": "1"},
        )
    for t in _ticks(x0, x1, 6):
        ET.SubElement(
            svg,
            "text",
            x=f"{px(t):.1f}",
            y=str(HEIGHT - PAD_B + 14),
            attrib={**label, "text-anchor": "middle"},
        ).text = _fmt(t)
    ET.SubElement(
        svg, "text", x=str(WIDTH - PAD_R), y=str(HEIGHT - 4), attrib={**label, "text-anchor": "end"}
    ).text = "step"
    for n, (name, values) in enumerate(series.items()):
        colour = COLOURS[n % len(COLOURS)]
        runs: list[list[str]] = [[]]
        for x, y in zip(xs, values, strict=True):
            if y is None or not math.isfinite(y):
                runs.append([])
            else:
                runs[-1].append(f"{px(float(x)):.1f},{py(float(y)):.1f}")
        for pts in runs:
            if len(pts) == 1:
                cx, cy = pts[0].split(",")
                ET.SubElement(svg, "circle", cx=cx, cy=cy, r="2.5", fill=colour)
            elif pts:
                ET.SubElement(
                    svg,
                    "polyline",
                    points=" ".join(pts),
                    fill="none",
                    stroke=colour,
                    attrib={"stroke-width": "2"},
                )
        lx = WIDTH - PAD_R - 110 * (len(series) - n)  # legends right-aligned, clear of the title
        ET.SubElement(svg, "rect", x=str(lx), y="9", width="10", height="10", fill=colour)
        ET.SubElement(svg, "text", x=str(lx + 14), y="18", attrib=label).text = name
    return ET.tostring(svg, encoding="unicode")


def training_charts(tl: Mapping[str, Sequence[float | None]]) -> dict[str, str]:
    """The over-training page's charts from :func:`crl_gym.explorer.queries.timeline`."""
    xs = [float(x) for x in tl["steps"] if x is not None]
    return {
        "bank_size": line_chart("Bank size", xs, {"entries": tl["bank_size"]}),
        "ops": line_chart(
            "Adds / Updates / Merges per step",
            xs,
            {"adds": tl["adds"], "updates": tl["updates"], "merges": tl["merges"]},
        ),
        "rbar": line_chart(
            "Mean r̄(m) of the retrieved entries", xs, {"mean r̄(m)": tl["mean_rbar"]}
        ),
    }

"""`python -m mlx_flashnorm.bench --matrix`: the throughput bench at every shape x prompt length.

Each point is one run of decode.bench (every mode in one process, a warm-up round, then
interleaved rounds); the points go into one table (matrix.md, matrix.json) and one chart
(matrix.png): decode and prefill tok/s per mode, median and spread, ratio to rms and to mlx-lm.
The files are rewritten after every point, so a run stopped by a time limit keeps what it
measured; `--merge` makes one table and chart from the matrix.json files of several runs (a
matrix split over calls of a limited length, as on the lent GPU machines).
"""
import json
import shutil
import tempfile
from pathlib import Path

from .. import progress
from ..errors import UserError
from ..loader import resolve_dtype
from .decode import (SHAPES, bench, check_context, config_file, context_length, log, plot, positive,
                     random_checkpoint, settings, shape, write_atomic)

LONG = (4096, 1792)  # the long prompt: the first that fits the model's context with --tg


def prompt_lengths(text, name, config, tg):
    """The prompt lengths of --pp (a comma-separated list of numbers and 'long') for one model."""
    lengths = []
    for item in (t.strip() for t in text.split(",")):
        if item == "long":
            fits = [n for n in LONG if n + tg <= context_length(config)]
            if not fits:
                log(f"note: {name}: no long prompt ({' or '.join(map(str, LONG))} tokens) fits its "
                    f"context of {context_length(config)} with --tg {tg}; skipped")
                continue
            lengths.append(fits[0])
        else:
            lengths.append(positive(item, "--pp"))
            check_context(name, config, lengths[-1], tg)
    return list(dict.fromkeys(lengths))


def run_settings(report):
    """What the points of a matrix share: the bench's settings line and the generated tokens."""
    return f"{settings(report)} | tg{report['tg']}"


def table(reports):
    """One row per point and mode: decode (tg) then prefill (pp), median, spread, ratios."""
    def ratio(x):
        return "-" if x is None else f"{x:.2f}"

    lines = [run_settings(reports[0]), "",
             "| model | prompt | mode | decode t/s | decode spread | decode vs rms "
             "| decode vs mlx-lm | prefill t/s | prefill spread | prefill vs rms "
             "| prefill vs mlx-lm |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in reports:
        for mode, res in r["results"].items():
            cells = []
            for test in ("tg", "pp"):
                s = res[f"{test}_summary"]
                cells += [f"{s['median']:.1f}", f"{s['min']:.1f} - {s['max']:.1f}",
                          ratio(res[f"{test}_vs_rms"]), ratio(res[f"{test}_vs_mlx_lm"])]
            lines.append(f"| {r['model']} | {r['pp']} | {mode} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def run_matrix(args, modes):
    models = [shape(s.strip()) for s in args.shape.split(",")] if args.shape else []
    models += [config_file(f) for f in args.config or []]
    models = models or list(SHAPES.values())
    points = [(name, config, prompt_lengths(args.pp or "128,long", name, config, args.tg))
              for name, config in models]  # every argument is checked before the first build
    points = [p for p in points if p[2]]
    if not points:
        raise UserError("nothing to run: every prompt length was skipped")
    reports = []
    total = progress.bar(total=sum(len(p[2]) for p in points), desc="matrix", unit="point")
    with tempfile.TemporaryDirectory() as tmp, total:
        for i, (name, config, lengths) in enumerate(points):
            label = f"{name} (random weights)"
            log(f"building {label}...")
            folder = random_checkpoint(Path(tmp) / f"model{i}", config)
            for pp in lengths:
                log(f"{label}: pp{pp} tg{args.tg}")
                bits = 4 if args.bits is None else args.bits or None
                reports.append(bench(modes, folder, label, bits, resolve_dtype(args.dtype, config),
                                     pp, args.tg, args.reps, args.group_size, log=log))
                md = write(reports, Path(args.out))
                total.update()
            shutil.rmtree(folder)  # a large shape's random weights take gigabytes of disk
    print(md)
    print(f"wrote {args.out}/matrix.md, matrix.json, matrix.png")


def write(reports, out):
    """matrix.md (each run's command, then the table), matrix.json and matrix.png in out; returns
    the table."""
    out.mkdir(parents=True, exist_ok=True)
    md = table(reports)
    commands = "\n".join(f"Command: `{c}`" for c in dict.fromkeys(r["command"] for r in reports))
    write_atomic(out / "matrix.md", f"{commands}\n\n{md}")
    write_atomic(out / "matrix.json", json.dumps(reports, indent=1))
    plot(reports, out / "matrix.png")
    return md


def merge(files, out):
    """One table and chart from the matrix.json files of earlier runs, which must share their
    settings (device, versions, dtype, bits, reps, tg): their points side by side."""
    reports = []
    for f in files:
        try:
            points = json.loads(Path(f).read_text())
        except OSError as e:
            raise UserError(f"{f}: cannot read it ({e.strerror or e}); --merge takes matrix.json "
                            "files")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{f}: not JSON; --merge takes the matrix.json files of --matrix runs")
        if not (isinstance(points, list) and points
                and all(isinstance(p, dict) and "results" in p for p in points)):
            raise UserError(f"{f}: not a matrix.json of a --matrix run")
        reports += points
    first = run_settings(reports[0])
    for other in map(run_settings, reports):
        if other != first:
            raise UserError(f"the runs differ in their settings ({first} against {other}): "
                            "merge only runs of one device and one set of options")
    md = write(reports, out)
    print(md)
    print(f"wrote {out}/matrix.md, matrix.json, matrix.png")

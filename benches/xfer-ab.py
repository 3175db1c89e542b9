#!/usr/bin/env python3
"""Compares builds of xfer-bench in one sitting on one machine.

    python3 benches/xfer-ab.py OUT ROUNDS NAME=BINARY [NAME=BINARY ...] -- XFER_BENCH_FLAGS

Runs every build's xfer-bench binary once a round, ROUNDS rounds, each into OUT/NAME-ROUND
(its report.json and plots). The order of the builds turns round by round (A B C, B C A,
C A B, ...), so that no build always runs right after the same other one. Prints, per row,
cuda-resident's figure of each run of each build, their median, and each build's median over
the first build's, then the raw driver's median over the first build's runs. A binary may be
a script that adds flags of its own (`exec xfer-bench --paging-batches 16 "$@"`).

Example, two builds' paging suites, three rounds:

    python3 benches/xfer-ab.py /tmp/ab 3 old=old/xfer-bench new=new/xfer-bench -- \\
        --suite paging --paging-blocks 16KiB
"""
import json
import os
import statistics
import subprocess
import sys


def main():
    if '--' not in sys.argv or len(sys.argv) < 5:
        sys.exit(__doc__)
    sep = sys.argv.index('--')
    out, rounds = sys.argv[1], int(sys.argv[2])
    builds = [arg.split('=', 1) for arg in sys.argv[3:sep]]
    flags = sys.argv[sep + 1:]
    reports = {name: [] for name, _ in builds}
    # Interrupted (Ctrl-C, `timeout -s INT`), it stops the build in hand and prints the table
    # of the runs that finished.
    try:
        for k in range(rounds):
            turn = builds[k % len(builds):] + builds[:k % len(builds)]
            for name, binary in turn:
                where = os.path.join(out, f'{name}-{k}')
                os.makedirs(where, exist_ok=True)
                run = subprocess.run([binary, '--out', where] + flags, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
                print(f'# {name}, round {k}: exit {run.returncode}', flush=True)
                for line in run.stdout.splitlines():
                    if line.startswith('breakdown'):
                        print('  ', line)
                if run.returncode != 0:
                    print(run.stdout[-3000:])
                    continue
                with open(os.path.join(where, 'report.json')) as f:
                    reports[name].append(json.load(f))
    except KeyboardInterrupt:
        print('# interrupted: the table holds the runs that finished', flush=True)
    first = builds[0][0]
    if not reports[first]:
        sys.exit('the first build has no report')

    def figures(name, case, method):
        return [row[method] for rep in reports[name] for row in rep['rows']
                if row['case'] == case and row.get(method) is not None]

    names = [name for name, _ in builds]
    print('case | ' + ' | '.join(f'{n}: runs (median)' for n in names) + ' | '
          + ' | '.join(f'{n} / {first}' for n in names[1:]) + ' | raw')
    for case in [row['case'] for row in reports[first][0]['rows']]:
        medians, cells = {}, []
        for n in names:
            runs = figures(n, case, 'cuda_resident')
            medians[n] = statistics.median(runs) if runs else None
            cells.append(' '.join(f'{v:.3f}' for v in runs) + (f' ({medians[n]:.3f})' if runs else ''))
        ratios = [f'{medians[n] / medians[first]:.3f}' if medians[n] and medians[first] else '-'
                  for n in names[1:]]
        raw = figures(first, case, 'raw')
        print(f'{case} | ' + ' | '.join(cells) + ' | ' + ' | '.join(ratios) + ' | '
              + (f'{statistics.median(raw):.3f}' if raw else '-'))


if __name__ == '__main__':
    main()

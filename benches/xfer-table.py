#!/usr/bin/env python3
"""Renders runs of one xfer-bench suite as BENCHMARKS.md's table: a row per case, each
figure the median of the runs' medians, cuda-resident's lowest and highest in brackets.

    python3 benches/xfer-table.py REPORT.json [REPORT.json ...]
"""
import json
import statistics
import sys


def figure(v):
    if v is None:
        return 'n/a'
    if v >= 1:
        return f'{v:,.2f}'
    return f'{v:#.2g}'


def ratio(r):
    return f'{r:,.0f}x' if r >= 10 else f'{r:.2f}x'


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    reports = [json.load(open(p)) for p in sys.argv[1:]]
    print('| case | unit | raw driver | `cuMemcpyBatchAsync` | cuda-resident (min-max) | vs raw |')
    print('|---|---|---:|---:|---:|---:|')
    for row in reports[0]['rows']:
        case = row['case']
        runs = [r for rep in reports for r in rep['rows'] if r['case'] == case]
        med = {}
        for key in ('raw', 'batch', 'cuda_resident'):
            vals = [r[key] for r in runs if r.get(key) is not None]
            med[key] = statistics.median(vals) if vals else None
        ours = [r['cuda_resident'] for r in runs if r.get('cuda_resident') is not None]
        if med['cuda_resident'] is None:
            continue
        span = f' ({figure(min(ours))}-{figure(max(ours))})' if len(ours) > 1 else ''
        if med['raw']:
            faster = med['raw'] / med['cuda_resident'] if row['unit'] == 'µs' else med['cuda_resident'] / med['raw']
            vs = ratio(faster)
        else:
            vs = 'n/a'
        print(f"| {case} | {row['unit']} | {figure(med['raw'])} | {figure(med['batch'])} | "
              f"{figure(med['cuda_resident'])}{span} | {vs} |")


if __name__ == '__main__':
    main()

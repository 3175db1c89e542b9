#!/usr/bin/env python3
"""Turns the raw text output kept beside a run record (`docs/runs/*.txt`) into JSON, so that
a figure quoted from an A/B record can be looked up by case and build; a Markdown record
whose figures are printed in it (criterion's estimates, alloc-bench's output) takes the same
path.

    python3 benches/records-to-json.py docs/runs/RECORD.txt [...]   # writes RECORD.json beside it

It copies figures as printed and computes none. The text is cut into sections at the lines
that start a call (`=== ...`, `## ...`, `# call ...`, `# python3 ...`); in each section it
reads:

- tables: `benches/xfer-ab.py`'s (`case | A: runs (median) | ... | raw`), xfer-bench's text
  table and the older fixed-width A/B table (`case  unit  old (runs)  new (runs) ...`); a cell
  of runs becomes a list (`runs`, and `median` where printed); xfer-bench rows printed
  without their header take its columns and say so (`columns_assumed`);
- timings: one line per measurement from the CUDA harnesses of `benches/cuda/` and
  alloc-bench (`NAME  614 us  54.61 GB/s`, `NAME  72.7 ns`, `NAME  8.36 %`);
- breakdowns: `--breakdown` lines, kept as text;
- Markdown tables (`| a | b |`), a row per line under the header;
- notes: every other line that is not empty (round headers, provenance, comments).

The .txt stays the source; the JSON is a reading aid that a script can load.
"""
import json
import os
import re
import sys

UNIT = r'(GB/s|µs|us|ns|%)'
NUM = r'-?\d[\d,]*(?:\.\d+)?'
XFER_BENCH = ['case', 'unit', 'raw', 'batch API', 'cuda-resident', 'vs raw', 'vs batch']


def number(tok):
    tok = tok.strip()
    if tok in ('-', 'n/a', ''):
        return None
    t = tok[:-1] if tok.endswith('x') else tok
    if re.fullmatch(NUM, t):
        return float(t.replace(',', ''))
    return tok


def cell(text):
    text = text.strip()
    m = re.fullmatch(r'((?:%s\s+)*%s)\s+\((%s)\)' % (NUM, NUM, NUM), text)
    if m:
        return {'runs': [number(v) for v in m.group(1).split()], 'median': number(m.group(2))}
    if re.fullmatch(r'%s(\s*/\s*%s)+' % (NUM, NUM), text):
        return [number(v) for v in text.split('/')]
    return number(text)


def split_header(rest):
    return [c for c in re.split(r'\s{2,}|\s(?=raw \(all runs\))', rest.strip()) if c]


def parse(text, markdown=False):
    sections = []
    sec = None
    table = None

    def new_section(title):
        nonlocal sec, table
        sec = {'title': title, 'notes': [], 'tables': [], 'timings': [], 'breakdowns': []}
        sections.append(sec)
        table = None

    new_section('')
    for line in text.splitlines():
        s = line.rstrip()
        if not s.strip():
            continue
        if re.match(r'^(=== |## |# call\b|# python3)', s):
            if sec['notes'] or sec['tables'] or sec['timings'] or sec['breakdowns'] or sec['title']:
                new_section(s.lstrip('=# ').strip())
            else:
                sec['title'] = s.lstrip('=# ').strip()
            continue
        if 'breakdown ' in s and ':' in s:
            sec['breakdowns'].append(s.strip())
            continue
        if s.startswith('|'):
            cells = [c.strip() for c in s.strip().strip('|').split('|')]
            if all(re.fullmatch(r':?-+:?', c) for c in cells):
                continue
            if table is None or table['format'] != 'markdown':
                table = {'format': 'markdown', 'columns': cells, 'rows': []}
                sec['tables'].append(table)
            else:
                table['rows'].append(dict(zip(table['columns'], [cell(c) for c in cells])))
            continue
        if s.startswith('case |') or s.startswith('case|'):
            table = {'format': 'pipe', 'columns': [c.strip() for c in s.split('|')], 'rows': []}
            sec['tables'].append(table)
            continue
        m = re.match(r'^case\s+unit\s+(.*)$', s) or re.match(r'^case \(.*?\)\s+(median)$', s)
        if m and not s.startswith('case |'):
            cols = split_header(m.group(1))
            table = {'format': 'fixed', 'columns': ['case', 'unit'] + cols, 'rows': []}
            sec['tables'].append(table)
            continue
        cells = [c.strip() for c in s.split('|')]
        if ' | ' in s and any(not isinstance(cell(c), str) for c in cells[1:]):
            if (table is None or table['format'] != 'pipe'
                    or len(cells) != len(table['columns'] or cells)):
                table = {'format': 'pipe', 'columns': None, 'rows': []}
                sec['tables'].append(table)
            if table['columns']:
                row = {'case': cells[0]}
                for name, c in zip(table['columns'][1:], cells[1:]):
                    row[name] = cell(c)
            else:
                row = {'cells': [cell(c) for c in cells]}
            table['rows'].append(row)
            continue
        m = re.match(r'^(?P<case>\S.*?)\s+(?P<unit>GB/s|µs)\s+(?P<rest>%s.*)$' % NUM, s)
        if m and (table is None or table['format'] != 'fixed') and len(m.group('rest').split()) == 5:
            # xfer-bench's rows printed without their header line: its columns
            table = {'format': 'fixed', 'columns': XFER_BENCH, 'columns_assumed': True, 'rows': []}
            sec['tables'].append(table)
        if m and table is not None and table['format'] == 'fixed':
            toks = m.group('rest').split()
            cols = table['columns'][2:]
            row = {'case': m.group('case').strip(), 'unit': m.group('unit')}
            if len(toks) == len(cols):
                for name, t in zip(cols, toks):
                    row[name] = cell(t)
            else:
                row['values'] = [cell(t) for t in toks]
            table['rows'].append(row)
            continue
        m = re.match(r'^(?P<case>.+?)\s+(?P<t>%s) (?P<tu>us|µs|ns)\s+(?P<g>%s) GB/s$' % (NUM, NUM), s)
        if m:
            sec['timings'].append({'case': m.group('case').strip(), m.group('tu'): number(m.group('t')),
                                   'GB/s': number(m.group('g'))})
            table = None
            continue
        m = re.match(r'^(?P<case>\S.*?|\s+\S.*?)\s{2,}(?P<v>%s) ?(?P<u>ns|us|µs|%%|GB/s)$' % NUM, s)
        if m:
            sec['timings'].append({'case': m.group('case').strip(), m.group('u'): number(m.group('v'))})
            continue
        sec['notes'].append(s)
        if not s.startswith('#'):
            table = None
    for sec in sections:
        sec['tables'] = [t for t in sec['tables'] if t['rows']]
        if markdown:
            sec['notes'] = []  # the prose is the record itself
        for key in ('notes', 'tables', 'timings', 'breakdowns'):
            if not sec[key]:
                del sec[key]
    return [s for s in sections if len(s) > 1]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        with open(path, encoding='utf-8') as f:
            text = f.read()
        out = {
            'source': os.path.basename(path),
            'made_by': 'benches/records-to-json.py: the figures of the source as printed, none computed',
            'sections': parse(text, markdown=path.endswith('.md')),
        }
        target = os.path.splitext(path)[0] + '.json'
        with open(target, 'w', encoding='utf-8') as f:
            json.dump(out, f, indent=1, ensure_ascii=False)
            f.write('\n')
        counts = [sum(len(t['rows']) for t in s.get('tables', [])) + len(s.get('timings', []))
                  + len(s.get('breakdowns', [])) for s in out['sections']]
        print(f'{target}: {len(out["sections"])} sections, {sum(counts)} figures rows')


if __name__ == '__main__':
    main()

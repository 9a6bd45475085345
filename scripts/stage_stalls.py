#!/usr/bin/env python3
"""Summarizes Nsight Compute's per-instruction source page (CSV, SASS) of one kernel: the total of
every numeric column (the stall reasons' samples among them), the instructions with the most
samples, and the samples per 4 KB of code (where in the kernel the warps wait).

usage: stage_stalls.py SOURCE.csv [TOP]"""
import collections
import csv
import sys


def number(s):
    try:
        return float(s.replace(',', ''))
    except ValueError:
        return None


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    rows = list(csv.reader(open(path, newline='', errors='replace')))
    head = next((i for i, r in enumerate(rows) if 'Address' in r and 'Source' in r), None)
    if head is None:
        sys.exit(f'{path}: no header with Address and Source columns')
    h = rows[head]
    addr, src = h.index('Address'), h.index('Source')
    body = [r for r in rows[head + 1:] if len(r) == len(h)]
    numeric = [j for j in range(len(h)) if j not in (addr, src) and any(number(r[j]) for r in body[:2000])]
    totals = {h[j]: sum(number(r[j]) or 0 for r in body) for j in numeric}
    print(f'{len(body)} instructions ({len(body) * 16 / 1024:.0f} KB)')
    for name, t in sorted(totals.items(), key=lambda x: -x[1]):
        if t:
            print(f'  {t:14.0f}  {name}')
    samples = next((j for j in numeric if h[j].startswith('Warp Stall Sampling (All')), None)
    if samples is None:
        return
    print(f'\ntop {top} instructions by "{h[samples]}":')
    reasons = [j for j in numeric if h[j].startswith('stall_') or 'Stall' in h[j] and j != samples]
    for r in sorted(body, key=lambda r: -(number(r[samples]) or 0))[:top]:
        why = sorted(((number(r[j]) or 0, h[j]) for j in reasons), reverse=True)[:2]
        print(f'  {r[addr]:>8s} {number(r[samples]) or 0:8.0f}  {r[src][:60]:60s} ' +
              ' '.join(f'{n}={v:.0f}' for v, n in why if v))
    by_page = collections.Counter()
    for r in body:
        a = int(r[addr], 16) if r[addr].startswith('0x') or all(c in '0123456789abcdef' for c in r[addr].lower()) else 0
        by_page[a // 4096] += number(r[samples]) or 0
    total = sum(by_page.values()) or 1
    print('\nsamples per 4 KB of code (pages with 1% or more):')
    for page, n in sorted(by_page.items()):
        if n / total >= 0.01:
            print(f'  {page * 4:6d} KB  {100 * n / total:5.1f}%')


if __name__ == '__main__':
    main()

"""The run's own record: what a run measured and kept of itself, read back by the command line and the loop.

- `ledger`: the goodput ledger each run directory keeps (its sessions, records, saves and audits, as JSON lines).
- `goodput`: the ledger's time added up into a report (productive, start-up, replay, saves, lost).
- `audit`: a resumed session's verdict on its replay, against the fingerprints the earlier sessions recorded.
- `cadence`: how often to save from the run's own figures (Young and Daly's interval, failure rate, drag),
  and the run's failure history (`RunHistory`).
- `fingerprints`: the state's and the data's checksums that the records and the audit compare.
- `environment`: what a checkpoint records of the machine and the software that wrote it.

`training/` and `checkpoint/` import these from below; these import neither.
"""

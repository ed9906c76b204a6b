"""The two tiers of a run: which one a restart restores from, what the processes agree on, and peer copies.

`restart` answers which tier (and which step) a restart restores; `agreement`
decodes what each process offers of its local tier and which step the offers
make whole; `peers` decides who keeps whose parts and moves them. The stores
below (`flaxstate.checkpoint.stores`) hold the steps; the readers and writers
above ask these modules.
"""

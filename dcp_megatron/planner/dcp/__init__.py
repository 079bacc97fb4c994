"""dcp: the batch's lengths decide CP sizes, packing, micro-batch counts and relief, per step.

The stages, in the order a plan is built:
- sized_sequences.py   each sequence's CP size and its alone-time there (the state the sizing rules grow);
- own_layout.py        PP = 1: the sizing rules, then list scheduling of size classes onto aligned blocks;
- odd_groups.py        the longest sequences on non-power-of-two groups instead, where that ends sooner;
- pipeline.py          PP > 1 (and ZeRO-3's lockstep): uniform waves and mixed waves (waves.py);
- relief_pass.py       each micro-batch's cheapest relief over a given layout (one per wave under ZeRO-3);
- lockstep_seeds.py    under ZeRO-3, dev's layout at the caps of a few wave counts as extra seeds;
- search.py            dcp's plan: its own layout, or a baseline's or a seed's with its own reliefs when faster;
- split.py             a large domain in node-aligned parts, each planned by search.py alone, then side by side.
"""

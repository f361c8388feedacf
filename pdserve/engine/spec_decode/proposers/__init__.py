"""The proposers a speculator drafts with (E20), one module each.

base.py         the interface: Proposer, TokenProposer (drafts before scheduling), SlotProposer
                (drafts into the granted slots), Drafted
ngram.py        NgramDrafts: prompt lookup
eagle.py        EagleDrafts: a draft head over the target's hidden states (pdserve.model.eagle_head)
self_draft.py   SelfDraft: the target's first k layers
draft_model.py  DraftModel: a separate, smaller checkpoint
drafting.py     DraftPicker and the batched draft passes the two drafting models share

docs/speculative-handoff.md says how a proposer plugs in.
"""

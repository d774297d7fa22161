"""Distillation from a frozen teacher dual encoder (open_clip's ``--distill-model``).

    config.py   the ``distill`` section (torch-free: rsclip_ds.config imports it)
    loss.py     soft cross-entropy between teacher and student logits over the global batch,
                with its single-process reference twin
    teacher.py  the frozen teacher (a SigLIP or CLIP folder / hub id; replicated, or partitioned by a
                ZeRO-3 engine of its own), its inputs' spec, the Distiller the train steps call

The teacher's inputs come from the loader (data/transforms.py two_views: the same crop at the
teacher's image size; data/loader.py Collate: its tokenizer); its bytes and FLOPs from the planner
(planning/teacher.py).

Nothing here is imported at package import time: ``import rsclip_ds.config`` stays torch-free.
"""

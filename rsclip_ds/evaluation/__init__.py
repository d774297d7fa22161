"""Zero-shot classification and image-text retrieval for a trained dual encoder.

    metrics.py    recall@k and zero-shot accuracy: pure functions of embeddings
    datasets.py   class folders, caption JSON, prompt templates -> EvalSets
    embed.py      Embedder (through the model's forward, split over ranks), evaluate()
    hook.py       periodic evaluation during training, its JSON and monitor events
    leakage.py    training shards against evaluation images by perceptual hash (check-leakage)

The `rsclip-ds eval` command is rsclip_ds/cli/eval.py.
"""

from rsclip_ds.evaluation.datasets import EvalSets
from rsclip_ds.evaluation.embed import Embedder, evaluate
from rsclip_ds.evaluation.metrics import flat_metrics, retrieval_metrics, zero_shot_metrics

__all__ = ["Embedder", "EvalSets", "evaluate", "flat_metrics", "retrieval_metrics", "zero_shot_metrics"]

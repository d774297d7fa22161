"""rsclip_ds: DeepSpeed ZeRO training for remote-sensing CLIP/SigLIP dual encoders."""

__version__ = "0.1.0"

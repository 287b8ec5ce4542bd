"""Codec training (seed §2.9): pack documents into fixed-length blocks, train the codec on a frozen backbone.

    from residualkv.training import pack_documents, resolve_source, TrainConfig, train_codec
"""

from .packing import DataError, PackedData, pack_documents, resolve_source
from .trainer import CodecTrainer, TrainConfig, TrainError, TrainResult, train_codec

__all__ = ["DataError", "PackedData", "pack_documents", "resolve_source",
           "CodecTrainer", "TrainConfig", "TrainError", "TrainResult", "train_codec"]

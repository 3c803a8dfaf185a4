"""Offline feature cache: run the target once, train many times.

``prepare`` (``eagle3fn prepare``) runs the target over chat data and ``write_cache``
stores one shard per batch; ``FeatureCache`` reads a shard back as the padded batch the
target ran on (``Features``), ``verify_cache`` checks every file (``eagle3fn cache
verify``) and ``cache_info`` sums what a cache holds (``eagle3fn cache info``).

Format 3 (``layout``): no padding on disk (each conversation's rows contiguous, an
offsets index), aux features at every real token, the target's final hidden state only
at the positions a teacher reads (``p = t + 1``, ``t`` supervised, SPEC 1), in bf16 /
fp32 or, behind ``aux_dtype="float8_e4m3"``, aux in fp8 e4m3 with a per-position,
per-layer scale. Safetensors shards, a manifest with a content fingerprint and a
sha256 per file (``manifest``), written atomically and resumable (``store``).

    manifest.py the manifest: format, digests, every field checked; the checks before training
    store.py    atomic shards, write_cache, resume; non-finite features refused
    layout.py   ragged rows <-> padded batch, teacher rows, fp8, sizes (pure)
    reader.py   FeatureCache, verify_cache, cache_info
    prepare.py  prepare, estimate
"""

from eagle3fn.io.cache.prepare import estimate, measured_bytes, prepare
from eagle3fn.io.cache.reader import CachedBatch, CacheReport, FeatureCache, FileStatus, cache_info, verify_cache
from eagle3fn.io.cache.manifest import (AUX_DTYPES, DTYPES, FORMAT_VERSION, HEAD, MANIFEST, cache_fingerprint,
                                        check_cache_for_training, read_manifest)
from eagle3fn.io.cache.store import check_resumable, write_cache

__all__ = ["AUX_DTYPES", "DTYPES", "FORMAT_VERSION", "HEAD", "MANIFEST", "CacheReport", "CachedBatch",
           "FeatureCache", "FileStatus", "cache_fingerprint", "cache_info", "check_cache_for_training",
           "check_resumable", "estimate", "measured_bytes", "prepare", "read_manifest", "verify_cache",
           "write_cache"]

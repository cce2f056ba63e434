"""Dynamic embedding tables for sparse ids: ``HashTable``, ``DynamicEmbedding`` and their
admission / filter policies.

``Initializer`` is the type of a new row's initializer (a callable filling a tensor in place);
``DEFAULT_POLICIES`` is the registry of the built-in policies that specs name.
"""

from .builtin_policies import GlobalStepFilter, ReadOnly
from .embedding import DynamicEmbedding, EmbeddingOption
from .hashtable import EvictionPlan, HashTable, Initializer, attach_optimizer
from .policy import AdmitPolicy, FilterPolicy
from .policy_spec import AdmitHook, FilterHook
from .registry import (
    DEFAULT_POLICIES,
    PolicyRegistry,
    register_admit_policy,
    register_filter_policy,
)

__all__ = [
    "AdmitHook",
    "FilterHook",
    "HashTable",
    "EvictionPlan",
    "Initializer",
    "attach_optimizer",
    "EmbeddingOption",
    "DynamicEmbedding",
    "AdmitPolicy",
    "FilterPolicy",
    "ReadOnly",
    "GlobalStepFilter",
    "PolicyRegistry",
    "DEFAULT_POLICIES",
    "register_admit_policy",
    "register_filter_policy",
]

"""Every public entry point checks its arguments' types first: None, a numpy array, an int, a
list, a str or a bool where it does not belong raises TypeError naming the parameter and
what it got, before the entry point does anything else.

The table below says, by hand, what each parameter takes; it must name every parameter of
every entry point, so a new or renamed parameter fails here until it is listed."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import jitk

TENSOR, OPTIONAL_TENSOR, INT, OPTIONAL_INT, FLOAT, STR, BOOL = (
    "tensor", "tensor or None", "int", "int or None", "float", "str", "bool")
TAKES = {  # what a parameter of each kind accepts, among the wrong-looking values below
    TENSOR: set(), OPTIONAL_TENSOR: {"None"}, INT: {"int"}, OPTIONAL_INT: {"None", "int"},
    FLOAT: {"int"}, STR: {"str"}, BOOL: {"bool"},
}
WRONG = {"None": None, "numpy": np.zeros(4, np.float32), "int": 3, "list": [1, 2],
         "str": "4", "bool": True}
GOT = {"None": "None", "numpy": "numpy.ndarray", "int": "int 3", "list": "list",
       "str": "str '4'", "bool": "bool True"}

HICACHE = {"unroll": OPTIONAL_INT, "block_quota": OPTIONAL_INT, "page_size": OPTIONAL_INT,
           "method": STR, "index_granularity": STR}
STAGED = {"src_indices": TENSOR, "dst_indices": TENSOR, "page_size": INT,
          "element_size": OPTIONAL_INT, "unroll": OPTIONAL_INT, "block_quota": OPTIONAL_INT}
ONE_LAYER = {"indices_dst": TENSOR, "indices_src": TENSOR, "element_dim": OPTIONAL_INT,
             **HICACHE}
ALL_LAYER = {"indices_dst": TENSOR, "indices_src": TENSOR, "element_size": OPTIONAL_INT,
             "num_tokens_src": OPTIONAL_INT, "num_tokens_dst": OPTIONAL_INT, **HICACHE}
PARAMETERS = {
    "rmsnorm": {"input": TENSOR, "weight": TENSOR, "out": OPTIONAL_TENSOR, "eps": FLOAT},
    "fused_add_rmsnorm": {"input": TENSOR, "residual": TENSOR, "weight": TENSOR, "eps": FLOAT,
                          "float_sum": BOOL},
    "transfer_hicache_one_layer": {"k_cache_dst": TENSOR, "v_cache_dst": TENSOR,
                                   "k_cache_src": TENSOR, "v_cache_src": TENSOR, **ONE_LAYER},
    "transfer_hicache_one_layer_mla": {"cache_dst": TENSOR, "cache_src": TENSOR, **ONE_LAYER},
    "transfer_hicache_all_layer": {
        "k_ptr_dst": TENSOR, "v_ptr_dst": TENSOR, "k_ptr_src": TENSOR, "v_ptr_src": TENSOR,
        "kv_cache_src_stride_bytes": INT, "kv_cache_dst_stride_bytes": INT,
        "kv_cache_src_page_stride_bytes": OPTIONAL_INT,
        "kv_cache_dst_page_stride_bytes": OPTIONAL_INT, **ALL_LAYER},
    "transfer_hicache_all_layer_mla": {
        "ptr_dst": TENSOR, "ptr_src": TENSOR, "cache_src_stride_bytes": INT,
        "cache_dst_stride_bytes": INT, "cache_src_page_stride_bytes": OPTIONAL_INT,
        "cache_dst_page_stride_bytes": OPTIONAL_INT, **ALL_LAYER},
    "transfer_hicache_all_layer_staged_lf_pf": {
        "k_ptr_src": TENSOR, "v_ptr_src": TENSOR, "staging_k": TENSOR, "staging_v": TENSOR,
        "dst_k": TENSOR, "dst_v": TENSOR, **STAGED},
    "transfer_hicache_all_layer_mla_staged_lf_pf": {
        "ptr_src": TENSOR, "staging": TENSOR, "dst": TENSOR, **STAGED},
    "stream_wait_value": {"flag": TENSOR, "value": INT, "op": STR},
    "stream_write_value": {"flag": TENSOR, "value": INT},
}
VALID = {TENSOR: lambda: torch.zeros(4, 8), OPTIONAL_TENSOR: lambda: None, INT: lambda: 16,
         OPTIONAL_INT: lambda: None, FLOAT: lambda: 1e-6, STR: lambda: "eq", BOOL: lambda: False}


def test_the_table_names_every_parameter_of_every_entry_point():
    for name, parameters in PARAMETERS.items():
        signature = inspect.signature(getattr(jitk, name))
        assert set(signature.parameters) == set(parameters), f"{name}: update PARAMETERS"


def wrong_calls():
    for function, parameters in PARAMETERS.items():
        for parameter, kind in parameters.items():
            for label in WRONG:
                if label not in TAKES[kind]:
                    yield pytest.param(function, parameter, label,
                                       id=f"{function}-{parameter}-{label}")


@pytest.mark.parametrize("function, parameter, label", list(wrong_calls()))
def test_wrong_type_names_the_parameter_and_what_it_got(function, parameter, label):
    entry = getattr(jitk, function)
    signature = inspect.signature(entry)
    arguments = {name: VALID[kind]() for name, kind in PARAMETERS[function].items()}
    arguments[parameter] = WRONG[label]
    args = [arguments.pop(name) for name, p in signature.parameters.items()
            if p.kind is p.POSITIONAL_OR_KEYWORD]
    with pytest.raises(TypeError) as error:
        entry(*args, **arguments)
    message = str(error.value)
    assert f"'{parameter}' must be" in message, message
    assert message.endswith(f"got {GOT[label]}"), message

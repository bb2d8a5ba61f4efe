"""Kernel names for tables: demangled, arguments dropped, templates folded to fit."""

from __future__ import annotations

import shutil

import pytest

from kimi_perf import names
from kimi_perf.names import short_names

FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, "
        "at::detail::Array<char*, 1>)")
# an AMD kernel as ROCm traces carry it: mangled, with C++23's std::bfloat16_t (DF16b)
MANGLED = "_ZN7ck_tile6kentryILi1ENS_12Rmsnorm2dFwdIDF16bEEJNS1_5KargsEEEEvDpT1_"


def test_arguments_and_void_go_and_templates_fold_until_the_name_fits():
    assert short_names([FILL], 200) == [
        "at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "at::detail::Array<char*, 1> >"]
    # one fold: the innermost template arguments
    assert short_names([FILL], 100) == [
        "at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<…>, "
        "at::detail::Array<…> >"]
    assert short_names([FILL], 60) == ["at::native::vectorized_elementwise_kernel<…>"]
    # no fold is short enough: cut, with an ellipsis, to exactly the width
    assert short_names([FILL], 30) == ["at::native::vectorized_elemen…"]
    assert len(short_names(["x" * 100], 20)[0]) == 20


@pytest.mark.parametrize("name, short", [
    ("triton_poi_fused__to_copy_1", "triton_poi_fused__to_copy_1"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
    ("void f<(anonymous namespace)::g>(int (*)(int))", "f<(anonymous namespace)::g>"),
    ("(anonymous)", "(anonymous)"),           # all parentheses: nothing to drop
    ("_Znot_really_mangled", "_Znot_really_mangled"),
    ("", ""),
])
def test_names_that_need_little_or_nothing(name, short):
    assert short_names([name]) == [short]


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="binutils' c++filt not here")
def test_mangled_names_are_demangled_in_one_call():
    readable = ("ck_tile::kentry<1, ck_tile::Rmsnorm2dFwd<std::bfloat16_t>, "
                "ck_tile::Rmsnorm2dFwd::Kargs>")
    assert short_names([MANGLED, "plain", MANGLED], 200) == [readable, "plain", readable]


def test_without_cxxfilt_names_stay_as_they_are(monkeypatch):
    monkeypatch.setattr(names.shutil, "which", lambda _: None)
    assert names.demangle([MANGLED, "plain"]) == [MANGLED, "plain"]
    monkeypatch.setattr(names.shutil, "which", lambda _: "/nonexistent/c++filt")
    assert names.demangle([MANGLED]) == [MANGLED]          # it fails to run: no error

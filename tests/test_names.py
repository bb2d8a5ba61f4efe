"""Kernel names for tables: demangled, arguments dropped, templates folded to fit."""

from __future__ import annotations

import re
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    # folded whole, the list keeps the operation it names (what tells PyTorch's kernels apart)
    assert short_names([FILL], 60) == ["at::native::vectorized_elementwise_kernel<…FillFunctor>"]
    # no fold is short enough: cut in the middle, head and tail kept, to exactly the width
    assert short_names([FILL], 30) == ["at::native::vector…illFunctor>"]
    assert len(short_names(["x" * 100], 20)[0]) == 20


def test_a_folded_list_keeps_the_operation_it_names():
    """PyTorch's reduce and elementwise kernels and ck_tile's kentry say what they compute
    only in their template arguments: a fold keeps the last functor, op or pass there, and
    folds a level more where that makes the name too wide."""
    mean = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
            "at::native::MeanOps<float, float, float, float>, unsigned int, float, 4> >"
            "(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, "
            "unsigned int, float, 4>)")
    assert short_names([mean], 100) == [
        "at::native::reduce_kernel<512, 1, at::native::ReduceOp<…MeanOps> >"]
    assert short_names([mean, mean.replace("MeanOps", "MaxOps")], 60) == [
        "at::native::reduce_kernel<…MeanOps>", "at::native::reduce_kernel<…MaxOps>"]
    # a reduction whose op is a lambda names none: not the ReduceOp that wraps every one
    lam = mean.replace("at::native::MeanOps<float, float, float, float>",
                       "at::native::func_wrapper_t<float, at::native::lambda_1>")
    assert short_names([lam], 40) == ["at::native::reduce_kernel<…>"]
    assert short_names(["ck_tile::kentry<1, ck_tile::Rmsnorm2dFwd<ck_tile::Pipeline<float>>, "
                        "ck_tile::Rmsnorm2dFwd::Kargs>"], 40) == [
        "ck_tile::kentry<…Rmsnorm2dFwd>"]
    assert short_names(["gemm<float, Tile<128, 64>>"], 10) == ["gemm<…>"]   # none named
    # add's functor, a lambda's kernel, not CUTLASS's operator class
    add = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnOther_add"
           "<float>, at::detail::Array<char*, 2> >(int)")
    silu = ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)"
            "::silu_kernel(at::TensorIteratorBase&)::{lambda(float)#1}, at::detail::Array<char*,"
            " 2> >(int)")
    gemm = ("cutlass::Kernel2<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GemmShape<128,"
            " 128, 32>, cutlass::arch::OpClassTensorOp>>")
    assert short_names([add, silu, gemm], 70) == [
        "at::native::vectorized_elementwise_kernel<…CUDAFunctorOnOther_add>",
        "at::native::vectorized_elementwise_kernel<…silu_kernel>",
        "cutlass::Kernel2<cutlass::gemm::kernel::GemmUniversal<…>>"]


def test_different_names_never_read_the_same():
    """Two GEMM variants that differ only in the middle of a long name, and two overloads
    that differ only in their arguments: each keeps a digest of its whole name."""
    a = ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT32x32x256_MI16x16x1_SN_LDSB1_AFC1_"
         "AFEM1_ASEM1_CLR1_CADS0_DTVA0_NTA0_NEPBS8_LRVW8_LWPMn1_MIAV0_MIWT1_1_WG32_8_1")
    b = a.replace("NTA0_NEPBS8", "NTA4_NEPBS8")
    short = short_names([a, b, a, "f(int)", "f(float)", "g(int)"], 60)
    assert short[0] == short[2] != short[1] and short[3] != short[4]
    assert all(len(x) <= 60 for x in short) and short[5] == "g"
    assert short[0].startswith("Cijk_Alik") and short[0][-5] == "~"


@pytest.mark.parametrize("name, short", [
    ("triton_poi_fused__to_copy_1", "triton_poi_fused__to_copy_1"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
    ("void f<(anonymous namespace)::g>(int (*)(int))", "f<(anonymous namespace)::g>"),
    ("(anonymous)", "(anonymous)"),           # all parentheses: nothing to drop
    ("Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD (Pinned -> Device)"),  # words, no list
    ("Memset (Device)", "Memset (Device)"),
    ("foo(int) [clone .part.0]", "foo"),
    ("foo(int) [clone .isra.0] [clone .cold]", "foo"),   # (GCC stacks its clone suffixes)
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


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="binutils' c++filt not here")
def test_one_call_for_all_and_odd_names_left_alone(monkeypatch):
    (readable,) = names.demangle([MANGLED])
    calls = []
    run = names.subprocess.run
    monkeypatch.setattr(names.subprocess, "run", lambda *a, **k: calls.append(a) or run(*a, **k))
    odd = "_Z3foov\rx"                      # would not stay one line for c++filt
    assert names.demangle([MANGLED, "_Z3barv", odd, MANGLED]) == [readable, "bar()", odd,
                                                                   readable]
    assert len(calls) == 1


def test_a_demangler_answer_of_the_wrong_length_changes_nothing(monkeypatch):
    class Done:
        stdout = "only one line\n"
    monkeypatch.setattr(names.shutil, "which", lambda _: "/usr/bin/c++filt")
    monkeypatch.setattr(names.subprocess, "run", lambda *a, **k: Done())
    assert names.demangle([MANGLED, "_Z3barv"]) == [MANGLED, "_Z3barv"]


def test_without_cxxfilt_names_stay_as_they_are(monkeypatch):
    monkeypatch.setattr(names.shutil, "which", lambda _: None)
    assert names.demangle([MANGLED, "plain"]) == [MANGLED, "plain"]
    monkeypatch.setattr(names.shutil, "which", lambda _: "/nonexistent/c++filt")
    assert names.demangle([MANGLED]) == [MANGLED]          # it fails to run: no error


def _fold_by_regex(name: str, width: int) -> str:
    """The plain statement of the folding: innermost lists folded a level at a time while the
    name is too wide (\x01 stands for a folded one, three characters wide)."""
    while len(name) + 2 * name.count("\x01") > width:
        folded = re.sub(r"<[^<>]*>", "\x01", name)
        if folded == name:
            break
        name = folded
    return name.replace("\x01", "<…>")


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="<>a ,", max_size=60), st.integers(0, 70))
def test_folding_in_one_pass_folds_as_the_level_by_level_statement_does(name, width):
    assert names._fold_templates(name, width) == _fold_by_regex(name, width)


def test_a_deeply_nested_name_folds():
    """200,000 levels of template arguments: one pass folds them (the level-by-level
    statement above would rewrite the name 200,000 times), and nothing recurses that deep."""
    deep = "f" + "<a" * 200_000 + ">" * 200_000 + "(int)"
    assert short_names([deep], 20) == ["f<a<a<a<a<a<…>>>>>>"]


def test_a_fold_keeps_the_last_operation_and_every_kind_it_names():
    """A list of several operations keeps its last (the functor a BinaryFunctor wraps), and
    each kind the pattern knows is kept: a lower-case functor (sum_functor), a backward pass
    (Bwd), a singular op, a lambda's ``_cuda`` kernel; a word that merely holds ``_kernel``
    (not a kernel function a lambda is scoped in) is no operation."""
    mul = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, "
           "float, float, at::native::MulFunctor<float> >, at::detail::Array<char*, 3> >(int)")
    assert short_names([mul], 70) == ["at::native::vectorized_elementwise_kernel<…MulFunctor>"]
    total = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
             "at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::"
             "operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, "
             "4> >(int)")
    assert short_names([total], 40) == ["at::native::reduce_kernel<…sum_functor>"]
    assert names._folded("<ck_tile::Layernorm2dBwd<float>, Kargs>") == "<…Layernorm2dBwd>"
    assert names._folded("<float, ns::SoftmaxOp<float>>") == "<…SoftmaxOp>"
    assert names._folded("<at::native::(anonymous namespace)::gelu_kernel_cuda("
                         "at::TensorIteratorBase&)::{lambda(float)#1}, Array<char*, 2>>"
                         ) == "<…gelu_kernel_cuda>"
    assert names._folded("<4, at::native::AbsFunctor<float>, policies::unroll_kernel_base>"
                         ) == "<…AbsFunctor>"


def test_a_name_exactly_as_wide_as_the_width_is_not_cut():
    """A name of exactly ``width`` characters fits: shown whole, its templates unfolded; one
    more is cut to the width, or folded. Without a width, a table's 80."""
    assert short_names(["x" * 20, "y" * 21], 20) == ["x" * 20, "yyyyyyyyyyyy…yyyyyyy"]
    (whole,) = short_names([FILL], 200)
    assert short_names([FILL], len(whole)) == [whole]
    assert short_names([FILL], len(whole) - 1) == [
        "at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<…>, "
        "at::detail::Array<…> >"]
    assert [len(s) for s in short_names(["z" * 80, "z" * 81])] == [80, 80]
    assert short_names(["z" * 81]) == ["z" * 48 + "…" + "z" * 31]

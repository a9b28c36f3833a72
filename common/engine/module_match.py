"""Which of ``transformers``' module classes compute what one of the engine's reference classes computes.

The engine's fused modules (RMSNorm, the gated MLP, RoPE attention; :mod:`common.engine.cpu_linear`,
:mod:`common.engine.fused_attention`) repeat the forward of a few Llama, Qwen2/3, Mistral, Phi-3 and Gemma
classes. Most families ship copies of those classes under their own names (``transformers``' modular files
generate ``Qwen3MoeRMSNorm``, ``MixtralAttention``, ``GraniteMLP`` ... from them). :func:`same_forward`
recognizes a copy by its ``forward``'s source, with the class's own methods it calls: the same code, comments
aside, once the names of its own kind of class (``...RMSNorm``, ``...Attention``, ``...MLP``) are set aside.
What the code calls beyond the module (the modeling file's ``apply_rotary_pos_emb``, the activation) and the
module's settings are the callers' to check, as they do for the reference classes themselves; each swap is also
checked against the module's output on a random input.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import io
import re
import textwrap
import tokenize

_KIND_NAMES = re.compile(r"\b\w+(?:RMSNorm|Attention|MLP)\b")
_CALLS = re.compile(r"\bself\.(\w+)\(")


@functools.cache
def _forward_text(cls: type) -> str | None:
    """``cls.forward``'s source and that of the class's own methods it calls (``self._norm(...)``), kind names
    set aside."""
    forward = getattr(cls, "forward", None)
    if forward is None:
        return None
    try:
        sources = [inspect.getsource(forward)]
        for name in dict.fromkeys(_CALLS.findall(sources[0])):
            helper = inspect.getattr_static(cls, name, None)
            if inspect.isfunction(helper):
                sources.append(inspect.getsource(helper))
    except (OSError, TypeError):  # defined in a notebook or built at run time: no source to read
        return None
    return _KIND_NAMES.sub("<kind>", " ".join(_code(textwrap.dedent(source)) for source in sources))


def _code(source: str) -> str:
    """``source``'s tokens without comments and line layout (copies differ in the family named in a comment)."""
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    try:
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        return " ".join(t.string for t in tokens if t.type not in skip)
    except (tokenize.TokenError, SyntaxError):
        return source


@functools.cache
def _reference(name: str) -> type:
    """``"llama.LlamaRMSNorm"``: that class of ``transformers.models.llama.modeling_llama``."""
    family, cls = name.split(".")
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls)


@functools.cache
def same_forward(cls: type, references: tuple[str, ...]) -> str | None:
    """The class name of the first of ``references`` (``"family.ClassName"`` each) whose forward ``cls``'s repeats
    (``cls``'s own name if it is one of them), or None."""
    classes = [_reference(name) for name in references]
    if cls in classes:
        return cls.__name__
    text = _forward_text(cls)
    if text is None:
        return None
    return next((ref.__name__ for ref in classes if _forward_text(ref) == text), None)

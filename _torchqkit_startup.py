"""Teach transformers quant_method "torchqkit" in every Python process where torchqkit is installed.

Note [Registering with transformers at interpreter start]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers looks a checkpoint's quant_method up in a registry that only its own methods fill. Clients that never
import torchqkit (lm-eval's CLI, accelerate, a plain from_pretrained script) would fail with "Unknown quantization
type" on a torchqkit checkpoint. So the installed package ships a ``.pth`` file (its one line is ``PTH_LINE``),
which Python's ``site`` runs at every interpreter start, and that line calls ``install()`` here. Choices:

  - Cheap at start: this module is stdlib only and does nothing but put a finder on ``sys.meta_path``; the finder
    compares one module name per import. torch, transformers and torchqkit are imported only when transformers
    itself imports its quantizer registry (``transformers.quantizers.auto``, which it does before it reads any
    quantization_config); torchqkit is imported right after that module has run, and registers. A process that
    never uses transformers pays for one small module.
  - A module outside the torchqkit package: importing ``torchqkit.anything`` would run torchqkit's ``__init__``,
    which imports torch.
  - Off switch: ``TORCHQKIT_NO_STARTUP_HOOK=1`` is read by the ``.pth`` line itself, so this module isn't even
    imported. ``import torchqkit`` still registers (torchqkit/integrations/hf_registration.py uses the same
    finder), as it always has.
  - Never fatal: the hook runs inside other programs' imports. If torchqkit can't be imported or can't register
    (an incompatible transformers), transformers keeps working and a warning says why.

setup.py writes ``PTH_LINE`` into the wheel's root (site-packages) for wheels and editable installs alike.
"""
import sys  # built in; importlib and warnings are imported only when the hook fires (each costs ~0.5 ms at start)

SWITCH = "TORCHQKIT_NO_STARTUP_HOOK"
PTH_NAME = "torchqkit-startup.pth"
# site executes a .pth line that starts with "import"; `os` is already imported by site, so the switch costs
# nothing, and with the switch set this module is not imported at all. An editable install whose source checkout
# was moved or deleted leaves the .pth behind with nothing to import: the line then does nothing, rather than
# printing a traceback at every interpreter start (`import torchqkit` still fails and says why). One line can't
# hold a try statement, so the line execs one.
PTH_LINE = (f"import os; os.environ.get({SWITCH!r}) == '1' or exec('try: import _torchqkit_startup as m\\n"
            f"except ImportError: pass\\nelse: m.install()')\n")

TRIGGER = "transformers.quantizers.auto"
_REGISTRATION = "torchqkit.integrations.hf_registration"


def install() -> None:
    """Register torchqkit with transformers now if its quantizer registry is imported, else right after it is."""
    if TRIGGER in sys.modules:
        _register()
    elif not any(isinstance(f, RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterOnImport())


def _register() -> None:
    import importlib
    import warnings
    try:
        registration = importlib.import_module(_REGISTRATION)
    except Exception as e:  # noqa: BLE001 - inside transformers' import: it must keep working without torchqkit
        warnings.warn(f"torchqkit is installed but could not be imported ({type(e).__name__}: {e}); transformers "
                      f"won't read torchqkit checkpoints. Set {SWITCH}=1 to stop trying at every start",
                      stacklevel=2)
        return
    registration.register_or_warn()


class RegisterOnImport:
    """A meta-path finder that wraps the loader of transformers.quantizers.auto once, then leaves ``sys.meta_path``:
    the module runs as usual and torchqkit registers right after it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def exec_then_register(module, _exec=exec_module):
                    _exec(module)
                    _register()

                spec.loader.exec_module = exec_then_register
                return spec
        return None

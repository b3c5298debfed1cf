"""Warnings raised by lightning_lowmem."""


class NoEffectWarning(UserWarning):
    """A transform or callback matched nothing and so changed nothing (e.g. a policy no module fits)."""


class LowMemWarning(UserWarning):
    """A setting works but costs memory or speed the user may not expect."""

"""``python -m jax_efc ...`` is the ``jax-efc`` command."""

from jax_efc.cli import main

raise SystemExit(main())

"""``python -m labs.bench ...``: see :mod:`labs.bench`."""

from labs.bench import main

main()

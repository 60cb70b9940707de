"""`python -m opencomposer.cli ...`"""

from opencomposer.cli import main

main()

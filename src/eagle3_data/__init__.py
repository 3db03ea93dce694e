"""eagle3_data: the library behind the EAGLE-3 training-data Snakemake workflow.

Stages (one module each, same name as the rule in ``rules/`` and the script in ``scripts/``):
``normalize`` -> ``generate`` -> ``tokenize`` -> ``validate`` -> ``merge`` -> ``extract`` -> ``report``.
"""

__version__ = "0.1.0"

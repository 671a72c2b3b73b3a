"""Package discovery that sees the kernels/ -> dapo_kernels mapping (pyproject.toml holds the rest).

setuptools' [tool.setuptools.packages.find] would install kernels/ under its folder name, `kernels`,
which is another PyPI package's import name; a hand-written list forgot dapo_megatron.dataplane once
(every non-editable install failed on import). Discovery here lists every folder with an
__init__.py, under the name it is imported by.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["dapo_megatron", "dapo_megatron.*"])
packages += ["dapo_kernels" + name[len("kernels") :] for name in find_packages(include=["kernels", "kernels.*"])]
setup(packages=packages)

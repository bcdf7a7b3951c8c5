from setuptools import find_packages, setup

setup(
    name="dflash2",
    version="0.1.0",
    description="Train DFlash and DFlash 2 speculative-decoding draft models at scale",
    packages=find_packages(include=["dflash2", "dflash2.*"]),
    python_requires=">=3.11",
    # Exact pins live in requirements.txt; these are the runtime imports.
    install_requires=[
        "torch",
        "transformers",
        "safetensors",
        "pyyaml",
        "pydantic",
        "tqdm",
    ],
)

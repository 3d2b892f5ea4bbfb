"""crl_gym: experience-augmented Gymnasium wrappers, the experience bank and text environments."""
__version__ = "0.1.0"

"""WebShop (Yao et al., 2022): its text interface and reward, over the original data files or the
small catalog shipped in ``data/``. The env is :class:`crl_gym.envs.webshop.env.WebShopEnv`."""

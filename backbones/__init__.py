"""Modern ImageNet backbones under timm's names (ResNet, ViT, ConvNeXt, a mobile model), each a
module of this package registered in `models.MODELS`, and the import of their pretrained weights
from timm/torchvision state_dicts (`backbones/weights.py`)."""

"""The smallest member of each backbone family, registered for the tests of what a family's
layers do rather than what its size costs (export: every layer kind through every format; the
weight import of a layout, where registered with the family's key map).

A family is one class at other depths and widths (`ResNet.depths`/`widths`, ...): these run its
code with one block per stage and a few features, so a test compiles and converts in seconds
instead of minutes. Importing this module registers them.
"""

from flax import nnx

from backbones import common
from backbones import convnext
from backbones import efficientnet
from backbones import mobilenetv3
from backbones import resnet
from backbones import vit
import models


@models.MODELS.register('small_resnet_for_test')
class SmallResNet(resnet.ResNet):
  block, depths, widths = resnet.BasicBlock, (1, 1, 1, 1), (8, 16, 24, 32)


@models.MODELS.register('small_convnext_for_test', key_map=convnext.KEY_MAP)
class SmallConvNeXt(convnext.ConvNeXt):
  depths, widths = (1, 1, 1, 1), (8, 16, 24, 32)


@models.MODELS.register('small_efficientnet_for_test', key_map=efficientnet.KEY_MAP)
class SmallEfficientNet(efficientnet.EfficientNet):
  # Both block kinds (no expansion; expansion with a 3x3 and a 5x5 depthwise convolution), one
  # with its skip connection.
  stages = ((1, 3, 1, 1, 8), (2, 3, 2, 6, 16), (1, 5, 2, 6, 24))
  stem_features, head_features = 8, 32


@models.MODELS.register('small_efficientnet_lite_tf_for_test', key_map=efficientnet.KEY_MAP)
class SmallEfficientNetLiteTF(efficientnet.EfficientNet):
  # EfficientNet-Lite as TensorFlow's port (tf_efficientnet_lite0; MobileNetV2's layer kinds
  # too): ReLU6, no squeeze-and-excitation, 'SAME' padding of strided 3x3 and 5x5 convolutions
  # on even and odd sizes, BatchNorm epsilon 1e-3.
  stages = ((1, 3, 1, 1, 8), (2, 3, 2, 6, 16), (1, 5, 2, 6, 24))
  stem_features, head_features = 8, 32
  style = efficientnet.BlockStyle(activation=nnx.relu6, squeeze_excite=False, padding='SAME',
                                  bn_epsilon=1e-3)


@models.MODELS.register('small_mobilenetv3_small_for_test')
class SmallMobileNetV3Small(mobilenetv3.MobileNetV3):
  # MobileNetV3-Small's first block: no expansion, a stride-2 depthwise convolution and
  # squeeze-and-excitation; then an expansion by a ratio that is no integer (4.5).
  stages = ((mobilenetv3.Blocks(1, 3, 2, 1, 8, True, nnx.relu),),
            (mobilenetv3.Blocks(1, 5, 2, 4.5, 16, True, mobilenetv3.hard_swish),))
  stem_features, conv_features, head_features = 8, 24, 32


@models.MODELS.register('small_mobilenetv3_for_test')
class SmallMobileNetV3(mobilenetv3.MobileNetV3):
  # Each layer kind: a block without expansion (ReLU, with its skip connection), expansion with
  # a stride-2 5x5 depthwise convolution, and hard-swish with squeeze-and-excitation (and its
  # skip connection).
  stages = ((mobilenetv3.Blocks(1, 3, 1, 1, 8, False, nnx.relu),),
            (mobilenetv3.Blocks(1, 5, 2, 3, 16, False, nnx.relu),
             mobilenetv3.Blocks(1, 3, 1, 2.5, 16, True, mobilenetv3.hard_swish)))
  stem_features, conv_features, head_features = 8, 24, 32


_SMALL_MOBILENET_V3_STAGES = (
    (mobilenetv3.Blocks(1, 3, 1, 1, 8, False, nnx.relu),),
    (mobilenetv3.Blocks(1, 5, 2, 3, 16, False, nnx.relu),
     mobilenetv3.Blocks(1, 3, 1, 2.5, 16, True, mobilenetv3.hard_swish)))


@models.MODELS.register('small_mobilenet_v3_for_test',
                        key_map=mobilenetv3.torchvision_key_map(_SMALL_MOBILENET_V3_STAGES))
class SmallMobileNetV3Torchvision(mobilenetv3.MobileNetV3):
  # torchvision's layout and epsilon; its last convolution widens 6x, as torchvision's does.
  stages = _SMALL_MOBILENET_V3_STAGES
  stem_features, conv_features, head_features = 8, 96, 32
  bn_epsilon = 1e-3


@models.MODELS.register('small_vit_for_test', key_map=vit.KEY_MAP)  # Its weights import.
class SmallViT(vit.VisionTransformer):
  features, depth, num_heads = 24, 2, 2


@models.MODELS.register('small_dinov2_for_test')
class SmallDinov2(vit.Dinov2):
  # With registers: layer scale, register tokens and the embedding of the patches alone.
  features, depth, num_heads = 24, 2, 2
  reg_tokens, no_embed_class = 4, True


@models.MODELS.register('small_deit_for_test')
class SmallDeiT(vit.VisionTransformer):
  # The distillation token and its head.
  features, depth, num_heads = 24, 2, 2
  distilled = True


@models.MODELS.register('small_siglip_for_test')
class SmallSiglip(vit.VisionTransformer):
  # No class token; the attention pool's cross-attention.
  features, depth, num_heads = 24, 2, 2
  class_token, global_pool = False, 'map'


@models.MODELS.register('small_clip_quickgelu_for_test')
class SmallClipQuickGelu(vit.VisionTransformer):
  # OpenAI CLIP's: a LayerNorm before the blocks, no patch bias, torch's epsilon, QuickGELU.
  features, depth, num_heads = 24, 2, 2
  pre_norm, patch_bias, norm_epsilon = True, False, 1e-5
  mlp_activation = staticmethod(common.quick_gelu)


FAMILIES = ('small_clip_quickgelu_for_test', 'small_convnext_for_test', 'small_deit_for_test',
            'small_dinov2_for_test', 'small_efficientnet_for_test',
            'small_efficientnet_lite_tf_for_test', 'small_mobilenetv3_for_test',
            'small_mobilenetv3_small_for_test', 'small_resnet_for_test', 'small_siglip_for_test',
            'small_vit_for_test')

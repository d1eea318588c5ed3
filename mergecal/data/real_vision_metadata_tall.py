"""The TALL-mask tasks' class names and templates: generated, do not edit.

Class names (in the datasets' label order) and zero-shot templates of the twelve tasks the TALL-mask
paper (arXiv:2405.07813) adds to the standard eight, as FusionBench 0.2.33 (PyPI wheel fusion_bench)
evaluates them: fusion_bench/tasks/clip_classification/<module>.py, copied by
scripts/copy_fusionbench_metadata.py (templates as str.format strings with one {}).
"""

from __future__ import annotations

TALL_TASKS: tuple[str, ...] = (
    'Flowers102', 'PCAM', 'FER2013', 'OxfordIIITPet', 'STL10', 'CIFAR100', 'CIFAR10', 'Food101', 'FashionMNIST',
    'EMNIST', 'KMNIST', 'RenderedSST2',
)

# flower102.py (classnames: 102 classes; 1 templates)
_FLOWERS102_CLASSNAMES = (
    'pink primrose', 'hard-leaved pocket orchid', 'canterbury bells', 'sweet pea', 'english marigold', 'tiger lily',
    'moon orchid', 'bird of paradise', 'monkshood', 'globe thistle', 'snapdragon', "colt's foot", 'king protea',
    'spear thistle', 'yellow iris', 'globe-flower', 'purple coneflower', 'peruvian lily', 'balloon flower',
    'giant white arum lily', 'fire lily', 'pincushion flower', 'fritillary', 'red ginger', 'grape hyacinth',
    'corn poppy', 'prince of wales feathers', 'stemless gentian', 'artichoke', 'sweet william', 'carnation',
    'garden phlox', 'love in the mist', 'mexican aster', 'alpine sea holly', 'ruby-lipped cattleya', 'cape flower',
    'great masterwort', 'siam tulip', 'lenten rose', 'barbeton daisy', 'daffodil', 'sword lily', 'poinsettia',
    'bolero deep blue', 'wallflower', 'marigold', 'buttercup', 'oxeye daisy', 'common dandelion', 'petunia',
    'wild pansy', 'primula', 'sunflower', 'pelargonium', 'bishop of llandaff', 'gaura', 'geranium', 'orange dahlia',
    'pink-yellow dahlia?', 'cautleya spicata', 'japanese anemone', 'black-eyed susan', 'silverbush',
    'californian poppy', 'osteospermum', 'spring crocus', 'bearded iris', 'windflower', 'tree poppy', 'gazania',
    'azalea', 'water lily', 'rose', 'thorn apple', 'morning glory', 'passion flower', 'lotus', 'toad lily',
    'anthurium', 'frangipani', 'clematis', 'hibiscus', 'columbine', 'desert-rose', 'tree mallow', 'magnolia',
    'cyclamen', 'watercress', 'canna lily', 'hippeastrum', 'bee balm', 'ball moss', 'foxglove', 'bougainvillea',
    'camellia', 'mallow', 'mexican petunia', 'bromelia', 'blanket flower', 'trumpet creeper', 'blackberry lily',
)
_FLOWERS102_TEMPLATES = (
    'a photo of a {}, a type of flower.',
)

# pcam.py (classnames: 2 classes; 1 templates)
_PCAM_CLASSNAMES = (
    'lymph node', 'lymph node containing metastatic tumor tissue',
)
_PCAM_TEMPLATES = (
    'this is a photo of {}',
)

# fer2013.py (classnames: 7 classes; 6 templates)
_FER2013_CLASSNAMES = (
    'angry', 'disgusted', 'fearful', 'happy', 'neutral', 'sad', 'surprised',
)
_FER2013_TEMPLATES = (
    'a photo of a {} looking face.', 'a photo of a face showing the emotion: {}.', 'a photo of a face looking {}.',
    'a face that looks {}.', 'they look {}.', 'look at how {} they are.',
)

# oxford_iiit_pet.py (classnames: 37 classes; 1 templates)
_OXFORDIIITPET_CLASSNAMES = (
    'abyssinian', 'american_bulldog', 'american_pit_bull_terrier', 'basset_hound', 'beagle', 'bengal', 'birman',
    'bombay', 'boxer', 'british_shorthair', 'chihuahua', 'egyptian_mau', 'english_cocker_spaniel', 'english_setter',
    'german_shorthaired', 'great_pyrenees', 'havanese', 'japanese_chin', 'keeshond', 'leonberger', 'maine_coon',
    'miniature_pinscher', 'newfoundland', 'persian', 'pomeranian', 'pug', 'ragdoll', 'russian_blue',
    'saint_bernard', 'samoyed', 'scottish_terrier', 'shiba_inu', 'siamese', 'sphynx', 'staffordshire_bull_terrier',
    'wheaten_terrier', 'yorkshire_terrier',
)
_OXFORDIIITPET_TEMPLATES = (
    'a photo of a {}, a type of pet.',
)

# stl10.py (classnames: 10 classes; 2 templates)
_STL10_CLASSNAMES = (
    'airplane', 'bird', 'car', 'cat', 'deer', 'dog', 'horse', 'monkey', 'ship', 'truck',
)
_STL10_TEMPLATES = (
    'a photo of a {}.', 'a photo of the {}.',
)

# cifar100.py (fine_label: 100 classes; 18 templates)
_CIFAR100_CLASSNAMES = (
    'apple', 'aquarium_fish', 'baby', 'bear', 'beaver', 'bed', 'bee', 'beetle', 'bicycle', 'bottle', 'bowl', 'boy',
    'bridge', 'bus', 'butterfly', 'camel', 'can', 'castle', 'caterpillar', 'cattle', 'chair', 'chimpanzee', 'clock',
    'cloud', 'cockroach', 'couch', 'cra', 'crocodile', 'cup', 'dinosaur', 'dolphin', 'elephant', 'flatfish',
    'forest', 'fox', 'girl', 'hamster', 'house', 'kangaroo', 'keyboard', 'lamp', 'lawn_mower', 'leopard', 'lion',
    'lizard', 'lobster', 'man', 'maple_tree', 'motorcycle', 'mountain', 'mouse', 'mushroom', 'oak_tree', 'orange',
    'orchid', 'otter', 'palm_tree', 'pear', 'pickup_truck', 'pine_tree', 'plain', 'plate', 'poppy', 'porcupine',
    'possum', 'rabbit', 'raccoon', 'ray', 'road', 'rocket', 'rose', 'sea', 'seal', 'shark', 'shrew', 'skunk',
    'skyscraper', 'snail', 'snake', 'spider', 'squirrel', 'streetcar', 'sunflower', 'sweet_pepper', 'table', 'tank',
    'telephone', 'television', 'tiger', 'tractor', 'train', 'trout', 'tulip', 'turtle', 'wardrobe', 'whale',
    'willow_tree', 'wolf', 'woman', 'worm',
)
_CIFAR100_TEMPLATES = (
    'a photo of a {}.', 'a blurry photo of a {}.', 'a black and white photo of a {}.',
    'a low contrast photo of a {}.', 'a high contrast photo of a {}.', 'a bad photo of a {}.',
    'a good photo of a {}.', 'a photo of a small {}.', 'a photo of a big {}.', 'a photo of the {}.',
    'a blurry photo of the {}.', 'a black and white photo of the {}.', 'a low contrast photo of the {}.',
    'a high contrast photo of the {}.', 'a bad photo of the {}.', 'a good photo of the {}.',
    'a photo of the small {}.', 'a photo of the big {}.',
)

# cifar10.py (classnames: 10 classes; 18 templates)
_CIFAR10_CLASSNAMES = (
    'airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck',
)
_CIFAR10_TEMPLATES = (
    'a photo of a {}.', 'a blurry photo of a {}.', 'a black and white photo of a {}.',
    'a low contrast photo of a {}.', 'a high contrast photo of a {}.', 'a bad photo of a {}.',
    'a good photo of a {}.', 'a photo of a small {}.', 'a photo of a big {}.', 'a photo of the {}.',
    'a blurry photo of the {}.', 'a black and white photo of the {}.', 'a low contrast photo of the {}.',
    'a high contrast photo of the {}.', 'a bad photo of the {}.', 'a good photo of the {}.',
    'a photo of the small {}.', 'a photo of the big {}.',
)

# food101.py (classnames: 101 classes; 1 templates)
_FOOD101_CLASSNAMES = (
    'apple pie', 'baby back ribs', 'baklava', 'beef carpaccio', 'beef tartare', 'beet salad', 'beignets',
    'bibimbap', 'bread pudding', 'breakfast burrito', 'bruschetta', 'caesar salad', 'cannoli', 'caprese salad',
    'carrot cake', 'ceviche', 'cheese plate', 'cheesecake', 'chicken curry', 'chicken quesadilla', 'chicken wings',
    'chocolate cake', 'chocolate mousse', 'churros', 'clam chowder', 'club sandwich', 'crab cakes', 'creme brulee',
    'croque madame', 'cup cakes', 'deviled eggs', 'donuts', 'dumplings', 'edamame', 'eggs benedict', 'escargots',
    'falafel', 'filet mignon', 'fish and chips', 'foie gras', 'french fries', 'french onion soup', 'french toast',
    'fried calamari', 'fried rice', 'frozen yogurt', 'garlic bread', 'gnocchi', 'greek salad',
    'grilled cheese sandwich', 'grilled salmon', 'guacamole', 'gyoza', 'hamburger', 'hot and sour soup', 'hot dog',
    'huevos rancheros', 'hummus', 'ice cream', 'lasagna', 'lobster bisque', 'lobster roll sandwich',
    'macaroni and cheese', 'macarons', 'miso soup', 'mussels', 'nachos', 'omelette', 'onion rings', 'oysters',
    'pad thai', 'paella', 'pancakes', 'panna cotta', 'peking duck', 'pho', 'pizza', 'pork chop', 'poutine',
    'prime rib', 'pulled pork sandwich', 'ramen', 'ravioli', 'red velvet cake', 'risotto', 'samosa', 'sashimi',
    'scallops', 'seaweed salad', 'shrimp and grits', 'spaghetti bolognese', 'spaghetti carbonara', 'spring rolls',
    'steak', 'strawberry shortcake', 'sushi', 'tacos', 'takoyaki', 'tiramisu', 'tuna tartare', 'waffles',
)
_FOOD101_TEMPLATES = (
    'a photo of {}, a type of food.',
)

# fashion_mnist.py (classnames: 10 classes; 2 templates)
_FASHIONMNIST_CLASSNAMES = (
    'T - shirt / top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt', 'Sneaker', 'Bag', 'Ankle boot',
)
_FASHIONMNIST_TEMPLATES = (
    'a photo of a {}.', 'a photo of the {}.',
)

# emnist_letters.py (classnames: 26 classes; 1 templates)
_EMNIST_CLASSNAMES = (
    'A', 'B', 'C', 'D', 'E', 'F', 'G', 'H', 'I', 'J', 'K', 'L', 'M', 'N', 'O', 'P', 'Q', 'R', 'S', 'T', 'U', 'V',
    'W', 'X', 'Y', 'Z',
)
_EMNIST_TEMPLATES = (
    'a photo of the digit character: "{}".',
)

# kmnist.py (classnames: 10 classes; 1 templates)
_KMNIST_CLASSNAMES = (
    'お', 'き', 'す', 'つ', 'な', 'は', 'ま', 'や', 'れ', 'を',
)
_KMNIST_TEMPLATES = (
    'a photo of the character {}.',
)

# rendered_sst2.py (classnames: 2 classes; 1 templates)
_RENDEREDSST2_CLASSNAMES = (
    'negative', 'positive',
)
_RENDEREDSST2_TEMPLATES = (
    'a {} review of a movie.',
)

CLASSNAMES: dict[str, tuple[str, ...]] = {
    'Flowers102': _FLOWERS102_CLASSNAMES,
    'PCAM': _PCAM_CLASSNAMES,
    'FER2013': _FER2013_CLASSNAMES,
    'OxfordIIITPet': _OXFORDIIITPET_CLASSNAMES,
    'STL10': _STL10_CLASSNAMES,
    'CIFAR100': _CIFAR100_CLASSNAMES,
    'CIFAR10': _CIFAR10_CLASSNAMES,
    'Food101': _FOOD101_CLASSNAMES,
    'FashionMNIST': _FASHIONMNIST_CLASSNAMES,
    'EMNIST': _EMNIST_CLASSNAMES,
    'KMNIST': _KMNIST_CLASSNAMES,
    'RenderedSST2': _RENDEREDSST2_CLASSNAMES,
}
TEMPLATES: dict[str, tuple[str, ...]] = {
    'Flowers102': _FLOWERS102_TEMPLATES,
    'PCAM': _PCAM_TEMPLATES,
    'FER2013': _FER2013_TEMPLATES,
    'OxfordIIITPet': _OXFORDIIITPET_TEMPLATES,
    'STL10': _STL10_TEMPLATES,
    'CIFAR100': _CIFAR100_TEMPLATES,
    'CIFAR10': _CIFAR10_TEMPLATES,
    'Food101': _FOOD101_TEMPLATES,
    'FashionMNIST': _FASHIONMNIST_TEMPLATES,
    'EMNIST': _EMNIST_TEMPLATES,
    'KMNIST': _KMNIST_TEMPLATES,
    'RenderedSST2': _RENDEREDSST2_TEMPLATES,
}

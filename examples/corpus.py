"""A small offline corpus for the examples: short encyclopedia-style articles."""

DOCS = {
    "eiffel": (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
        "between 1887 and 1889 as the centrepiece of the 1889 World's Fair. Although it was criticised "
        "at first by some of France's leading artists and intellectuals for its design, it has become a "
        "global cultural icon of France and one of the most recognisable structures in the world. The "
        "tower is 330 metres tall, about the same height as an 81-storey building, and was the tallest "
        "man-made structure in the world until the Chrysler Building in New York was finished in 1930. "
        "It has three levels for visitors, with restaurants on the first and second levels."
    ),
    "fuji": (
        "Mount Fuji is an active stratovolcano on the Japanese island of Honshu. At 3,776 metres it is "
        "the highest mountain in Japan and the second-highest volcano on an island in Asia. It last "
        "erupted in 1707 and 1708. The mountain lies about 100 kilometres south-west of Tokyo and can be "
        "seen from there on a clear day. Its exceptionally symmetrical cone, covered in snow for about "
        "five months of the year, is a well-known symbol of Japan and is often depicted in art and "
        "photography. Mount Fuji is one of Japan's Three Holy Mountains, and it was added to the World "
        "Heritage List as a cultural site in 2013. Every summer hundreds of thousands of people climb it."
    ),
    "python": (
        "Python is a high-level, general-purpose programming language. Its design philosophy emphasises "
        "code readability with the use of significant indentation. Guido van Rossum began working on "
        "Python in the late 1980s as a successor to the ABC programming language and first released it "
        "in 1991. Python 2.0 was released in 2000, and Python 3.0, a major revision that was not "
        "completely backward-compatible with earlier versions, was released in 2008. Python is "
        "dynamically typed and garbage-collected, and it supports several programming paradigms, "
        "including structured, object-oriented and functional programming. It is often described as a "
        "batteries-included language because of its comprehensive standard library."
    ),
    "amazon": (
        "The Amazon River in South America is the largest river by discharge volume of water in the "
        "world, and the disputed longest river system in the world in comparison to the Nile. The "
        "headwaters of the Apurimac River on Nevado Mismi had been considered for nearly a century as "
        "the Amazon basin's most distant source. The Amazon has an average discharge of about 215,000 "
        "cubic metres per second, more than the next seven largest independent rivers combined. Two "
        "thirds of the Amazon's main stem lies in Brazil. The Amazon basin is the largest drainage basin "
        "in the world, covering about seven million square kilometres, and its rainforest is home to an "
        "enormous variety of plants and animals."
    ),
    "curie": (
        "Marie Curie was a Polish and naturalised-French physicist and chemist who conducted pioneering "
        "research on radioactivity. She was the first woman to win a Nobel Prize, the first person to "
        "win a Nobel Prize twice, and the only person to win a Nobel Prize in two scientific fields. "
        "Her husband, Pierre Curie, was a co-winner of her first Nobel Prize, in physics in 1903. She "
        "won the 1911 Nobel Prize in Chemistry for the discovery of the elements polonium and radium. "
        "She was born in Warsaw in 1867, studied in Paris, and founded the Curie Institutes in Paris and "
        "in Warsaw, which remain major centres of medical research today. She died in 1934."
    ),
    "honey": (
        "Honey is a sweet and viscous substance made by several species of bees, the best-known of which "
        "are honey bees. Bees produce honey from the sugary secretions of plants, mostly floral nectar, "
        "by regurgitation, enzymatic activity and water evaporation, and store it in wax structures "
        "called honeycombs. Because of its low water content and acidity, honey resists the growth of "
        "bacteria and, if sealed, does not spoil: edible honey has been found in ancient Egyptian tombs "
        "thousands of years old. Honey gets its sweetness from the monosaccharides fructose and glucose "
        "and has about the same relative sweetness as table sugar."
    ),
}

// The calibration text `kestrel quantize` runs when no --calib file is given: two public-domain
// English texts, Abraham Lincoln's Gettysburg Address (1863, the Bliss copy) and the opening
// paragraph of Charles Dickens's A Tale of Two Cities (1859).
#pragma once

namespace kestrel::apps {

inline constexpr const char* kCalibrationText =
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal.\n\n"
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so "
    "dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a "
    "portion of that field, as a final resting place for those who here gave their lives that that nation might "
    "live. It is altogether fitting and proper that we should do this.\n\n"
    "But, in a larger sense, we can not dedicate\u2014we can not consecrate\u2014we can not hallow\u2014this "
    "ground. The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to "
    "add or detract. The world will little note, nor long remember what we say here, but it can never forget what "
    "they did here. It is for us the living, rather, to be dedicated here to the unfinished work which they who "
    "fought here have thus far so nobly advanced. It is rather for us to be here dedicated to the great task "
    "remaining before us\u2014that from these honored dead we take increased devotion to that cause for which "
    "they gave the last full measure of devotion\u2014that we here highly resolve that these dead shall not have "
    "died in vain\u2014that this nation, under God, shall have a new birth of freedom\u2014and that government of "
    "the people, by the people, for the people, shall not perish from the earth.\n\n"
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was "
    "the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything before "
    "us, we had nothing before us, we were all going direct to Heaven, we were all going direct the other "
    "way\u2014in short, the period was so far like the present period, that some of its noisiest authorities "
    "insisted on its being received, for good or for evil, in the superlative degree of comparison only.\n";

}  // namespace kestrel::apps

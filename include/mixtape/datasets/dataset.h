// The Dataset pipeline moved to mixtape/data/dataset.h (the models' layer may use it);
// this header stays for programs that include it by its earlier path.
#pragma once

#include "mixtape/data/dataset.h"
